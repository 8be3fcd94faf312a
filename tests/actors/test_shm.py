"""deepxd.shm: named shared-memory segments, shared with other processes, with no resource tracker."""

from __future__ import annotations

import itertools
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepxd.shm import (
    OutOfSharedMemory,
    Segment,
    SegmentExists,
    list_segments,
    orphan_segments,
    segment_exists,
    segment_name,
    segment_pid,
    shm_free_bytes,
    unlink_segment,
)

ROOT = Path(__file__).resolve().parents[2]
PREFIX = f"deepx-shmtest{os.getpid()}-"
_names = itertools.count()


@pytest.fixture(autouse=True)
def no_leaked_segments():
    yield
    left = list_segments(PREFIX)
    for name in left:
        unlink_segment(name)
    assert left == [], f"the test left shared-memory segments behind: {left}"


def fresh() -> str:
    return f"{PREFIX}{next(_names)}"


def python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, env=env, cwd=ROOT)


def test_create_attach_share_bytes_and_unlink():
    seg = Segment.create(fresh(), 24)
    try:
        assert seg.size == 24 and seg.name in list_segments(PREFIX)
        a = seg.array((2, 3), "float32")
        assert a.tolist() == [[0] * 3] * 2  # fresh memory is zero
        a[...] = np.arange(6).reshape(2, 3)
        other = Segment.attach(seg.name)
        assert other.size == 24
        b = other.array((2, 3), "float32")
        assert b.tolist() == [[0, 1, 2], [3, 4, 5]]
        b[1, 2] = 50
        assert a[1, 2] == 50
        other.close()
    finally:
        seg.close()
        seg.unlink()
    assert not segment_exists(seg.name)
    seg.unlink()  # twice is harmless


def test_segments_are_private_to_the_user():
    seg = Segment.create(fresh(), 10)
    try:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{seg.name}").st_mode) == 0o600
    finally:
        seg.close()
        seg.unlink()


def test_create_refuses_an_existing_name_and_attach_a_missing_one():
    seg = Segment.create(fresh(), 8)
    try:
        with pytest.raises(SegmentExists, match="already exists"):
            Segment.create(seg.name, 8)
    finally:
        seg.close()
        seg.unlink()
    with pytest.raises(DeepxError, match="no shared-memory segment named"):
        Segment.attach(seg.name)
    with pytest.raises(DeepxError, match="not valid"):
        Segment.create("a/b", 8)
    with pytest.raises(DeepxError, match="negative"):
        Segment.create(fresh(), -1)


def test_a_zero_size_segment_is_still_a_valid_segment():
    seg = Segment.create(fresh(), 0)
    try:
        assert seg.size == 1
        a = seg.array((0, 3), "float64")
        assert a.shape == (0, 3) and a.size == 0
        assert Segment.attach(seg.name).size == 1
    finally:
        seg.close()
        seg.unlink()


def test_array_takes_deepx_precisions_including_bfloat16_and_checks_the_size():
    seg = Segment.create(fresh(), 64)
    try:
        a = seg.array((4,), "bfloat16")
        assert a.dtype == np.dtype(ml_dtypes.bfloat16)
        a[...] = [1.5, -2, 3, 0.25]
        assert seg.array((4,), "bfloat16").astype(np.float32).tolist() == [1.5, -2, 3, 0.25]
        assert seg.array((2,), "int64", offset=8).nbytes == 16
        with pytest.raises(DeepxError, match="holds 64 bytes"):
            seg.array((9,), "float64")
        with pytest.raises(DeepxError, match="no storage"):
            seg.array((2,), "int4")
        seg.zero()
        assert not seg.array((64,), "int8").any()
    finally:
        seg.close()
        seg.unlink()


def test_close_with_live_views_keeps_them_valid():
    seg = Segment.create(fresh(), 16)
    a = seg.array((4,), "int32")
    seg.close()  # a view is still exported: the mapping stays until it goes
    a[...] = 7
    assert a.tolist() == [7] * 4 and seg.closed
    with pytest.raises(DeepxError, match="closed"):
        seg.array((4,), "int32")
    seg.unlink()


def test_another_process_attaches_reads_and_writes_and_no_tracker_unlinks_it():
    seg = Segment.create(fresh(), 8 * 4)
    try:
        seg.array((4,), "float64")[...] = [1, 2, 3, 4]
        r = python(f"""
            from deepxd.shm import Segment
            s = Segment.attach({seg.name!r})
            a = s.array((4,), "float64")
            print(a.tolist())
            a *= 10
            del a
            s.close()
        """)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "[1.0, 2.0, 3.0, 4.0]"
        assert r.stderr == ""  # no resource_tracker warning
        assert segment_exists(seg.name)  # the exiting process did not unlink it
        assert seg.array((4,), "float64").tolist() == [10, 20, 30, 40]
    finally:
        seg.close()
        seg.unlink()


def test_a_segment_made_by_another_process_outlives_it():
    name = fresh()
    r = python(f"""
        from deepxd.shm import Segment
        s = Segment.create({name!r}, 16)
        s.array((2,), "int64")[...] = [5, 6]
    """)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    seg = Segment.attach(name)
    try:
        assert seg.array((2,), "int64").tolist() == [5, 6]
    finally:
        seg.close()
        seg.unlink()


def test_names_and_listing():
    name = segment_name("node-1")
    assert name.startswith(f"deepx-node-1-{os.getpid()}-")
    assert segment_name("node-1") != name
    assert segment_pid(name, "node-1") == os.getpid()
    assert segment_pid(name, "node") is None
    assert segment_pid("PostgreSQL.123", "node-1") is None
    assert segment_name("a/b c").startswith("deepx-a_b_c-")
    made = [Segment.create(fresh(), 1) for _ in range(3)]
    try:
        assert list_segments(PREFIX) == sorted(s.name for s in made)
        assert list_segments(PREFIX + "nothing") == []
    finally:
        for s in made:
            s.close()
            assert unlink_segment(s.name)
    assert not unlink_segment(made[0].name)


def test_a_dropped_view_after_close_unmaps_and_no_descriptor_is_kept():
    import gc
    import weakref

    before = len(os.listdir("/proc/self/fd"))
    segs = [Segment.create(fresh(), 4096) for _ in range(300)]
    views = [s.array((4,), "float32") for s in segs]
    assert len(os.listdir("/proc/self/fd")) <= before + 2  # mapped, with no descriptor kept per segment
    owner = views[0]
    while isinstance(owner, np.ndarray):
        owner = owner.base
    mapping = weakref.ref(owner)  # the owner of the mapping: the views' base
    del owner
    for s in segs:
        s.close()
        s.unlink()
    views[0][...] = 5  # still mapped under the view
    assert views[0].tolist() == [5.0] * 4 and mapping() is not None
    del views
    gc.collect()
    assert mapping() is None  # unmapped once no view is left


def test_memory_is_reserved_at_create_and_grown_by_reserve():
    seg = Segment.create(fresh(), 1 << 20, reserve=8192)
    try:
        held = os.stat(f"/dev/shm/{seg.name}").st_blocks * 512
        assert 8192 <= held < 1 << 20 and seg.reserved == 8192
        seg.reserve(1 << 19)
        assert os.stat(f"/dev/shm/{seg.name}").st_blocks * 512 >= 1 << 19 and seg.reserved == 1 << 19
        full = Segment.create(fresh(), 1 << 16)
        assert os.stat(f"/dev/shm/{full.name}").st_blocks * 512 >= 1 << 16  # all of it by default
        full.close()
        full.unlink()
    finally:
        seg.close()
        seg.unlink()


def test_more_than_dev_shm_holds_is_refused_naming_the_bytes():
    free = shm_free_bytes()
    if free is None:
        pytest.skip("/dev/shm has no size limit here")
    name = fresh()
    with pytest.raises(OutOfSharedMemory, match=rf"{name!r}: {free * 2} bytes asked, \d+ bytes free") as e:
        Segment.create(name, free * 2)
    assert e.value.asked == free * 2 and not segment_exists(name)


def test_orphans_are_segments_of_dead_pids_that_nothing_names():
    live = Segment.create(f"deepx-shmtest{os.getpid()}x-{os.getpid()}-0", 4096)
    r = python(f"""
        import os
        from deepxd.shm import Segment
        for n in range(2):
            Segment.create(f"{PREFIX}o-{{os.getpid()}}-{{n}}", 4096)
        print(os.getpid())
    """)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout)
    try:
        dead = {f"{PREFIX}o-{pid}-0", f"{PREFIX}o-{pid}-1"}
        found = {o.name: o for o in orphan_segments(referenced={f"{PREFIX}o-{pid}-1"})}
        assert f"{PREFIX}o-{pid}-0" in found and f"{PREFIX}o-{pid}-1" not in found and live.name not in found
        o = found[f"{PREFIX}o-{pid}-0"]
        assert (o.pid, o.size, o.held, o.node) == (pid, 4096, 4096, f"{PREFIX}o"[len("deepx-"):])
    finally:
        for n in dead:
            unlink_segment(n)
        live.close()
        live.unlink()
