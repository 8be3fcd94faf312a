"""heapmem: heap tensors in shared memory, their refcounts and metadata in the plane, the pool, the lifecycle
list, and what survives a stop. Real KV, real shared memory, real subprocesses."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepxd.actors.heapmem import LIFECYCLE, HeapMemory, size_class
from deepxd.actors.messages import ArrayOf, Attach, Create, HeapDelete, HeapList, HeapStats, Info, Release
from deepxd.kv.base import open_kv
from deepxd.shm import list_segments, segment_exists, unlink_segment

ROOT = Path(__file__).resolve().parents[2]
NODES = f"hm{os.getpid()}n"  # every node id here starts so, and so do the names of its segments
_nodes = itertools.count()


@pytest.fixture(autouse=True)
def no_leaked_segments():
    yield
    left = list_segments(f"deepx-{NODES}")
    for name in left:
        unlink_segment(name)
    assert left == [], f"the test left shared-memory segments behind: {left}"


@pytest.fixture
def node() -> str:
    return f"{NODES}{next(_nodes)}"


def file_url(tmp_path: Path) -> str:
    return f"memory://{tmp_path}/kv.aof"  # tmp_path is absolute: memory:///tmp/...


@pytest.fixture(params=["memory", "file"])
async def kv(request, tmp_path):
    store = open_kv("memory" if request.param == "memory" else file_url(tmp_path))
    await store.connect()
    yield store
    await store.close()


@pytest.fixture
async def heap(kv, node):
    actor = HeapMemory(kv, node, poll_s=0.01)
    actor.start()
    yield actor
    await actor.stop()


#: heapmem's messages by name (deepxd/actors/messages.py), for the tests' short `ask(heap, "create", ...)`
MESSAGES = {m.message: m for m in (Create, Attach, Release, HeapDelete, ArrayOf, Info, HeapList, HeapStats)}


async def ask(actor: HeapMemory, message: str, **kwargs: Any) -> Any:
    return await actor.ref.ask(MESSAGES[message](**kwargs), timeout=10)


async def eventually(check: Callable[[], Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if asyncio.iscoroutine(result):
                result = await result
            if result is not False:
                return
        except (AssertionError, DeepxError):
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s")
        await asyncio.sleep(0.01)


def python(code: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, **kw)


def segments(node: str) -> list[str]:
    return list_segments(f"deepx-{node}-")


# -- create, attach, release, delete


async def test_create_attach_release_and_the_plane_after_each_step(heap, kv, node):
    info = await ask(heap, "create", name="w", shape=[2, 3], dtype="float32", owner="alice")
    assert info["handle"].startswith(f"deepx-{node}-{os.getpid()}-")
    assert {k: v for k, v in info.items() if k != "ctime"} == {
        "name": "w", "dtype": "float32", "shape": [2, 3], "node": node, "device": "cpu", "bytes": 24,
        "kind": "heap", "owner": "alice", "state": "live", "refcount": 1, "holders": ["alice"],
        "handle": info["handle"]}
    f = await kv.hgetall("tensor:w")
    assert abs(float(f.pop("ctime")) - time.time()) < 60
    assert f == {"dtype": "float32", "shape": "[2, 3]", "node": node, "device": "cpu", "bytes": "24", "kind": "heap",
                 "owner": "alice", "state": "live", "refcount": "1", "holders": "alice", "handle": info["handle"]}

    info = await ask(heap, "attach", name="w", holder="bob")
    assert (info["refcount"], info["holders"]) == (2, ["alice", "bob"])
    f = await kv.hgetall("tensor:w")
    assert (f["refcount"], f["holders"], f["state"]) == ("2", "alice,bob", "live")

    assert await ask(heap, "release", name="w", holder="alice") == 1
    f = await kv.hgetall("tensor:w")
    assert (f["refcount"], f["holders"]) == ("1", "bob")
    assert (await ask(heap, "info", name="w"))["holders"] == ["bob"]

    assert await ask(heap, "release", name="w", holder="bob") == 0
    assert not await kv.exists("tensor:w")
    with pytest.raises(DeepxError, match=r"'w'.*no heap tensor"):
        await ask(heap, "info", name="w")
    assert await ask(heap, "list") == []
    stats = await ask(heap, "stats")
    assert (stats["tensors"], stats["bytes"], stats["pooled_segments"], stats["pooled_bytes"]) == (0, 0, 1, 4096)


async def test_create_refuses_existing_names_bad_dtypes_and_bad_shapes(heap, kv, node):
    await ask(heap, "create", name="w", shape=[2], dtype="float32")
    with pytest.raises(DeepxError, match=r"heap tensor 'w'.*already exists"):
        await ask(heap, "create", name="w", shape=[2], dtype="float32")
    with pytest.raises(DeepxError, match=r"heap tensor 'q'.*'int4' has no storage"):
        await ask(heap, "create", name="q", shape=[2], dtype="int4")
    with pytest.raises(DeepxError, match=r"heap tensor 'q'.*unknown dtype 'float13'"):
        await ask(heap, "create", name="q", shape=[2], dtype="float13")
    with pytest.raises(DeepxError, match=r"heap tensor 'q'.*\[2, -1\] has the negative dimension -1"):
        await ask(heap, "create", name="q", shape=[2, -1], dtype="float32")
    with pytest.raises(DeepxError, match=r"heap tensor 'q'.*not a list of integers"):
        await ask(heap, "create", name="q", shape=[2.5], dtype="float32")
    with pytest.raises(DeepxError, match=r"heap tensor 'q'.*not a list of integers"):
        await ask(heap, "create", name="q", shape="2,3", dtype="float32")
    with pytest.raises(DeepxError, match=r"heap tensor 'q'.*without commas"):
        await ask(heap, "create", name="q", shape=[2], dtype="float32", owner="a,b")
    with pytest.raises(DeepxError, match="non-empty string name"):
        await ask(heap, "create", name="", shape=[2], dtype="float32")
    # a tensor that another node (or the registry, for a stack tensor) recorded under that name
    await kv.hset("tensor:s", {"kind": "stack", "node": "elsewhere"})
    with pytest.raises(DeepxError, match=r"heap tensor 's'.*storage plane.*stack tensor on node elsewhere"):
        await ask(heap, "create", name="s", shape=[2], dtype="float32")
    assert await kv.hgetall("tensor:s") == {"kind": "stack", "node": "elsewhere"}
    assert [t["name"] for t in await ask(heap, "list")] == ["w"]
    assert len(segments(node)) == 1  # the refusals made no segment


async def test_delete_refuses_while_others_hold_it_unless_forced(heap, kv, node):
    await ask(heap, "create", name="w", shape=[4], dtype="int32", owner="alice")
    await ask(heap, "attach", name="w", holder="bob")
    with pytest.raises(DeepxError, match=r"delete heap tensor 'w'.*2 references.*alice, bob.*force=True"):
        await ask(heap, "delete", name="w")
    assert (await kv.hgetall("tensor:w"))["refcount"] == "2"
    handle = (await ask(heap, "info", name="w"))["handle"]
    await ask(heap, "delete", name="w", force=True)
    assert not await kv.exists("tensor:w")
    # bob may still be reading it: its segment is unlinked, not pooled for a new tensor to overwrite
    assert not segment_exists(handle)
    assert (await ask(heap, "stats"))["pooled_segments"] == 0

    await ask(heap, "create", name="v", shape=[4], dtype="int32", owner="carol")
    await ask(heap, "delete", name="v")  # one reference: delete frees it
    assert not await kv.exists("tensor:v")
    assert (await ask(heap, "stats"))["pooled_segments"] == 1
    with pytest.raises(DeepxError, match=r"delete heap tensor 'v'.*no heap tensor"):
        await ask(heap, "delete", name="v")


async def test_release_needs_a_holder_of_the_tensor(heap, kv):
    await ask(heap, "create", name="w", shape=[1], dtype="float64", owner="alice")
    with pytest.raises(DeepxError, match=r"release heap tensor 'w'.*mallory does not hold it.*held by alice"):
        await ask(heap, "release", name="w", holder="mallory")
    with pytest.raises(DeepxError, match=r"release heap tensor 'w'.*unnamed holder"):
        await ask(heap, "release", name="w", holder="")
    assert (await kv.hgetall("tensor:w"))["refcount"] == "1"
    with pytest.raises(DeepxError, match=r"release heap tensor 'nope'.*no heap tensor"):
        await ask(heap, "release", name="nope", holder="alice")
    with pytest.raises(DeepxError, match=r"attach to heap tensor 'nope'.*no heap tensor"):
        await ask(heap, "attach", name="nope", holder="alice")
    # references without a holder name are counted too
    await ask(heap, "create", name="anon", shape=[1], dtype="float64")
    info = await ask(heap, "attach", name="anon", holder="")
    assert (info["refcount"], info["holders"]) == (2, [])
    assert await ask(heap, "release", name="anon", holder="") == 1
    assert await ask(heap, "release", name="anon", holder="") == 0
    assert not await kv.exists("tensor:anon")


async def test_array_is_a_zero_copy_view_in_every_precision(heap):
    await ask(heap, "create", name="w", shape=[2, 3], dtype="float32")
    a = await ask(heap, "array", name="w")
    assert a.shape == (2, 3) and a.dtype == np.float32 and not a.any()
    a[...] = 3
    b = await ask(heap, "array", name="w")
    assert np.shares_memory(a, b) and (b == 3).all()
    await ask(heap, "create", name="h", shape=[4], dtype="bfloat16")
    h = await ask(heap, "array", name="h")
    h[...] = [0.5, 1, 2, -4]
    assert (await ask(heap, "array", name="h")).astype(np.float32).tolist() == [0.5, 1, 2, -4]
    assert (await ask(heap, "info", name="h"))["bytes"] == 8
    with pytest.raises(DeepxError, match=r"view heap tensor 'nope'.*no heap tensor"):
        await ask(heap, "array", name="nope")


async def test_empty_and_scalar_tensors_get_valid_segments(heap, kv):
    info = await ask(heap, "create", name="e", shape=[0, 4], dtype="float32")
    assert info["bytes"] == 0 and segment_exists(info["handle"])
    assert (await ask(heap, "array", name="e")).shape == (0, 4)
    info = await ask(heap, "create", name="s", shape=[], dtype="int64")
    assert info["bytes"] == 8 and (await kv.hgetall("tensor:s"))["shape"] == "[]"
    s = await ask(heap, "array", name="s")
    s[()] = 42
    assert s.shape == () and int((await ask(heap, "array", name="s"))[()]) == 42


# -- sharing with other processes


async def test_another_process_attaches_by_the_handle_in_the_plane_and_both_see_each_others_writes(heap, kv):
    await ask(heap, "create", name="w", shape=[2, 3], dtype="float32", owner="trainer")
    (await ask(heap, "array", name="w"))[...] = np.arange(6).reshape(2, 3)
    f = await kv.hgetall("tensor:w")
    code = f"""
        import json, sys
        from deepxd.shm import Segment
        seg = Segment.attach({f["handle"]!r})
        a = seg.array(json.loads({f["shape"]!r}), {f["dtype"]!r})
        print(a.ravel().tolist(), flush=True)
        a += 100
        print("written", flush=True)
        sys.stdin.readline()
        print(a.ravel().tolist(), flush=True)
        del a
        seg.close()
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]"
        assert proc.stdout.readline().strip() == "written"
        a = await ask(heap, "array", name="w")
        assert a.ravel().tolist() == [100, 101, 102, 103, 104, 105]
        a[...] = -1
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == str([-1.0] * 6)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and err == "", err  # no resource tracker warning, and it unlinked nothing
    assert segment_exists(f["handle"])
    assert (await ask(heap, "array", name="w")).ravel().tolist() == [-1] * 6


# -- the pool


async def test_a_freed_segment_is_reused_by_the_next_create_of_its_size_class(heap, node):
    w = await ask(heap, "create", name="w", shape=[1000], dtype="float32")  # 4000 bytes: the 4 KiB class
    (await ask(heap, "array", name="w"))[...] = 7
    await ask(heap, "delete", name="w")
    assert (await ask(heap, "stats"))["pooled_segments"] == 1

    v = await ask(heap, "create", name="v", shape=[1024], dtype="float32")  # 4096 bytes: the same class
    assert v["handle"] == w["handle"] and segments(node) == [w["handle"]]
    assert not (await ask(heap, "array", name="v")).any()  # zeroed when reused
    (await ask(heap, "array", name="v"))[...] = 9
    await ask(heap, "delete", name="v")

    u = await ask(heap, "create", name="u", shape=[512], dtype="int64", zero=False)
    assert u["handle"] == w["handle"]
    assert (await ask(heap, "array", name="u")).view(np.float32).tolist() == [9] * 1024  # not zeroed when asked not to
    stats = await ask(heap, "stats")
    assert (stats["tensors"], stats["segments"], stats["pooled_segments"]) == (1, 1, 0)


async def test_a_somewhat_larger_pooled_segment_is_reused_but_not_a_much_larger_one(heap, node):
    big = await ask(heap, "create", name="big", shape=[16 << 10], dtype="int8")  # the 16 KiB class
    huge = await ask(heap, "create", name="huge", shape=[64 << 10], dtype="int8")  # the 64 KiB class
    await ask(heap, "delete", name="big")
    await ask(heap, "delete", name="huge")
    small = await ask(heap, "create", name="small", shape=[4 << 10], dtype="int8")  # 4 KiB: takes the 16 KiB one
    assert small["handle"] == big["handle"]
    tiny = await ask(heap, "create", name="tiny", shape=[100], dtype="int8")  # 64 KiB is too much for 100 bytes
    assert tiny["handle"] not in (big["handle"], huge["handle"])
    assert len(segments(node)) == 3


async def test_the_pool_keeps_at_most_pool_bytes(kv, node):
    heap = HeapMemory(kv, node, pool_bytes=2 * 4096, poll_s=0.01)
    heap.start()
    try:
        for i in range(3):
            await ask(heap, "create", name=f"t{i}", shape=[4096], dtype="int8")
        await ask(heap, "create", name="large", shape=[3 * 4096], dtype="int8")  # 16 KiB: more than the pool holds
        assert len(segments(node)) == 4
        for name in ("t0", "t1", "t2", "large"):
            await ask(heap, "delete", name=name)
        stats = await ask(heap, "stats")
        assert (stats["pooled_segments"], stats["pooled_bytes"], stats["pool_limit"]) == (2, 8192, 8192)
        assert len(segments(node)) == 2  # the rest were unlinked
    finally:
        await heap.stop()


def test_size_classes():
    assert [size_class(n) for n in (0, 1, 4096, 4097, 8192, 100_000)] == [4096, 4096, 4096, 8192, 8192, 131072]


# -- the lifecycle list


async def test_lifecycle_commands_are_applied_within_a_second_and_bad_ones_skipped(heap, kv, caplog):
    caplog.set_level(logging.WARNING, logger="deepxd.actors.heapmem")
    pack: Callable[[dict[str, Any]], bytes] = msgpack.packb  # type: ignore[assignment]
    await kv.rpush(LIFECYCLE,
                   pack({"cmd": "create", "name": "w", "shape": [3], "dtype": "float32", "owner": "loader"}),
                   pack({"cmd": "get", "name": "w", "holder": "trainer"}),
                   b"\xc1",  # not msgpack
                   pack([1, 2]),  # not a map
                   pack({"cmd": "explode", "name": "w"}),
                   pack({"cmd": "create", "name": "bad", "shape": [3], "dtype": "int4"}),
                   pack({"cmd": "get", "name": "missing", "holder": "x"}),
                   pack({"cmd": "create", "name": "v", "shape": [1], "dtype": "int8"}))

    async def applied() -> bool:
        names = [t["name"] for t in await ask(heap, "list")]
        return names == ["v", "w"] and await kv.llen(LIFECYCLE) == 0

    await eventually(applied, timeout=1.0)
    f = await kv.hgetall("tensor:w")
    assert (f["refcount"], f["holders"], f["owner"], f["shape"]) == ("2", "loader,trainer", "loader", "[3]")
    skipped = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(skipped) == 5, skipped
    assert any("not msgpack" in m for m in skipped) and any("not a map" in m for m in skipped)
    assert any("unknown cmd 'explode'" in m for m in skipped)
    assert any("'bad'" in m and "int4" in m for m in skipped)
    assert any("'missing'" in m for m in skipped)

    # delete with a holder releases that holder's reference; without one it deletes
    await kv.rpush(LIFECYCLE, pack({"cmd": "delete", "name": "w", "holder": "trainer"}),
                   pack({"cmd": "delete", "name": "v"}))

    async def released() -> bool:
        return (await kv.hgetall("tensor:w")).get("refcount") == "1" and not await kv.exists("tensor:v")

    await eventually(released, timeout=1.0)
    await kv.rpush(LIFECYCLE, pack({"cmd": "delete", "name": "w", "holder": "loader"}))

    async def freed() -> bool:
        return not await kv.exists("tensor:w") and await ask(heap, "list") == []

    await eventually(freed, timeout=1.0)
    assert (await ask(heap, "stats"))["pooled_segments"] == 2


async def test_a_store_that_refuses_the_lifecycle_list_is_polled_not_spun(tmp_path, node, caplog, monkeypatch):
    """Commands wait in the lifecycle list but the persisted store refuses every write (its disk is full: a failed
    append refuses the rest until a restart), so each pop fails: heapmem retries at the poll's pace, with a warning
    a poll, and the loop's other work goes on (a spin would hang every actor)."""
    import errno

    from deepxd.kv import memory

    caplog.set_level(logging.WARNING, logger="deepxd.actors.heapmem")
    store = open_kv(file_url(tmp_path))
    await store.connect()
    pack: Callable[[dict[str, Any]], bytes] = msgpack.packb  # type: ignore[assignment]
    await store.rpush(LIFECYCLE, pack({"cmd": "create", "name": "u", "shape": [2], "dtype": "float32"}))

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(memory.os, "write", full)
    actor = HeapMemory(store, node, poll_s=0.02)
    actor.start()
    try:
        # this loop's timers keep firing: 30 sleeps of 10 ms end (0.3 s on an idle machine, longer on a loaded one,
        # where a fixed 0.3 s need not hold 10 of them; a spin would hold them for ever), and heapmem tried at the
        # poll's pace meanwhile
        t0 = time.monotonic()
        for _ in range(30):
            await asyncio.sleep(0.01)
            assert time.monotonic() - t0 < 60, "the loop's timers stopped firing"
        elapsed = time.monotonic() - t0
        failed = [r for r in caplog.records if "polling" in r.getMessage()]
        assert 2 <= len(failed) <= elapsed / actor.poll_s + 5, (len(failed), elapsed)
        assert await store.llen(LIFECYCLE) == 1  # nothing lost: the command waits for a store that takes writes
    finally:
        monkeypatch.undo()
        await actor.stop()
        await store.close()


# -- stop and restart


async def test_stop_unlinks_every_segment_and_marks_the_live_tensors_stopped(kv, node):
    heap = HeapMemory(kv, node, poll_s=0.01)
    heap.start()
    await ask(heap, "create", name="a", shape=[10], dtype="float32")
    await ask(heap, "create", name="b", shape=[10], dtype="float32")
    await ask(heap, "create", name="gone", shape=[10], dtype="float32")
    await ask(heap, "delete", name="gone")  # into the pool
    assert len(segments(node)) == 3
    await heap.stop()
    assert segments(node) == []
    assert [(await kv.hgetall(f"tensor:{n}"))["state"] for n in ("a", "b")] == ["stopped", "stopped"]
    assert not await kv.exists("tensor:gone")


async def test_after_a_restart_on_the_same_plane_the_tensors_are_listed_as_lost(tmp_path, node):
    async with open_kv(file_url(tmp_path)) as kv:
        heap = HeapMemory(kv, node, poll_s=0.01)
        heap.start()
        await ask(heap, "create", name="w", shape=[2, 2], dtype="float32", owner="alice")
        await ask(heap, "attach", name="w", holder="bob")
        await heap.stop()

    async with open_kv(file_url(tmp_path)) as kv:
        heap = HeapMemory(kv, node, poll_s=0.01)
        heap.start()
        try:
            [info] = await ask(heap, "list")
            assert (info["name"], info["state"]) == ("w", "lost")
            assert (info["refcount"], info["holders"]) == (2, ["alice", "bob"])
            assert (await kv.hgetall("tensor:w"))["state"] == "lost"
            assert (await ask(heap, "stats"))["lost"] == 1
            with pytest.raises(DeepxError, match="heap tensor 'w' was lost when its daemon stopped; put or load it"):
                await ask(heap, "array", name="w")
            with pytest.raises(DeepxError, match="'w' was lost"):
                await ask(heap, "attach", name="w", holder="carol")
            with pytest.raises(DeepxError, match=r"create heap tensor 'w'.*lost.*delete it first"):
                await ask(heap, "create", name="w", shape=[2, 2], dtype="float32")
            await ask(heap, "delete", name="w", force=True)
            assert not await kv.exists("tensor:w")
            await ask(heap, "create", name="w", shape=[2, 2], dtype="float32")
        finally:
            await heap.stop()


async def test_a_restart_adopts_segments_that_outlived_a_dead_daemon_and_unlinks_its_orphans(kv, node):
    r = python(f"""
        from deepxd.shm import Segment, segment_name
        kept, orphan = Segment.create(segment_name({node!r}), 4096), Segment.create(segment_name({node!r}), 4096)
        kept.array((3,), "int32")[...] = [1, 2, 3]
        print(kept.name, orphan.name)
    """)  # and it dies without unlinking either
    assert r.returncode == 0, r.stderr
    kept, orphan = r.stdout.split()
    assert segment_exists(orphan)
    await kv.hset("tensor:w", {"dtype": "int32", "shape": "[3]", "node": node, "device": "cpu", "bytes": "12",
                               "kind": "heap", "owner": "a", "state": "live", "refcount": "2", "holders": "a,b",
                               "handle": kept, "ctime": "1.5"})
    other = {"dtype": "int32", "shape": "[3]", "node": "another-node", "kind": "heap", "state": "live",
             "handle": "deepx-another-node-1-1", "bytes": "12"}
    await kv.hset("tensor:x", other)
    heap = HeapMemory(kv, node, poll_s=0.01)
    heap.start()
    try:
        info = await ask(heap, "info", name="w")
        assert (info["state"], info["refcount"], info["holders"], info["handle"]) == ("live", 2, ["a", "b"], kept)
        assert (await ask(heap, "array", name="w")).tolist() == [1, 2, 3]
        assert segments(node) == [kept]  # the orphan is gone
        assert await kv.hgetall("tensor:x") == other  # another node's tensor is not ours to judge
        with pytest.raises(DeepxError, match=r"'x'.*no heap tensor"):
            await ask(heap, "info", name="x")
    finally:
        await heap.stop()
    assert segments(node) == [] and (await kv.hgetall("tensor:w"))["state"] == "stopped"


class _GpuMemory:
    """What heapmem asks of one GPU's memory (deepxd/actors/opcuda.py's DeviceHeap: alloc, view, free), over host
    arrays: no GPU here, and this test is about which GPU's memory heapmem goes to, not about CUDA."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.live: dict[str, np.ndarray] = {}

    async def alloc(self, name: str, nbytes: int, zero: bool) -> Any:
        from deepxd.actors.opcuda import DeviceBlock

        self.live[name] = np.zeros(nbytes, np.uint8)
        return DeviceBlock(self.live[name], nbytes, name.encode().ljust(64, b"\0"), self.device)

    async def view(self, block: Any, shape: Any, dtype: str) -> np.ndarray:
        assert any(a is block.allocation for a in self.live.values()), "viewed through another GPU's heap"
        return block.allocation.view(dtype).reshape(shape)

    def free(self, block: Any) -> None:
        name = next(n for n, a in self.live.items() if a is block.allocation)  # (StopIteration: another GPU's)
        del self.live[name]


async def test_each_gpu_worker_s_heap_tensors_live_on_its_own_gpu(kv, node) -> None:
    """With a worker per GPU, heapmem allocates, views and frees a heap tensor through the GPU of the worker that
    asks (a module's parameters are heap tensors; a kernel cannot read another GPU's memory), the first GPU's where
    none is said; a worker on another GPU asking for its view is refused, naming both."""
    gpus = {d: _GpuMemory(d) for d in ("cuda:0", "cuda:1")}
    actor = HeapMemory(kv, node, poll_s=0.01, device=gpus["cuda:0"], devices=dict(gpus))
    actor.start()
    try:
        await ask(actor, "create", name="w1", shape=[2, 3], dtype="float32", owner="op-cuda:1", device="cuda:1")
        await ask(actor, "create", name="w0", shape=[4], dtype="float32", owner="op-cuda", device="cuda:0")
        await ask(actor, "create", name="p", shape=[1], dtype="float32", owner="plane")  # no device: the first
        assert sorted(gpus["cuda:1"].live) == ["w1"] and sorted(gpus["cuda:0"].live) == ["p", "w0"]
        assert (await ask(actor, "info", name="w1"))["device"] == "cuda:1"
        assert (await ask(actor, "array", name="w1", device="cuda:1")).shape == (2, 3)
        with pytest.raises(DeepxError, match=r"heap tensor 'w1' lives on cuda:1, and the session asking for it runs "
                                             r"on cuda:0"):
            await ask(actor, "array", name="w1", device="cuda:0")
        await ask(actor, "delete", name="w1", force=True)
        await eventually(lambda: not gpus["cuda:1"].live)  # freed through its own GPU's heap
        assert sorted(gpus["cuda:0"].live) == ["p", "w0"]
    finally:
        await actor.stop()


async def test_the_check_reads_one_record_and_every_record_where_that_one_is_gone(heap, kv):
    """Republish(whole=False) reads the check's own key (a plane that lost its keys lost that one too); the whole
    check, and a light one that finds that key gone, write back every record the plane lost."""
    from deepxd.actors.messages import Republish

    for name in ("w0", "w1", "w2"):
        await ask(heap, "create", name=name, shape=[2], dtype="float32", owner="alice")
    assert await heap.ref.ask(Republish(whole=False), timeout=10) == 0  # the first check reads every record
    before = await kv.hgetall("tensor:w2")
    await kv.delete("tensor:w2")  # by hand, not the first: the light check does not see it
    assert await heap.ref.ask(Republish(whole=False), timeout=10) == 0
    assert await heap.ref.ask(Republish(whole=True), timeout=10) == 1
    assert await kv.hgetall("tensor:w2") == before
    await kv.delete("tensor:w0", "tensor:w1")  # as a flushed plane: the first is gone too
    assert await heap.ref.ask(Republish(whole=False), timeout=10) == 2
    assert not await kv.missing(["tensor:w0", "tensor:w1", "tensor:w2"])


async def test_a_lost_plane_is_seen_by_the_light_check_though_a_change_wrote_one_record_again(heap, kv):
    """A plane that lost every key, where a change to one tensor (a hold, say) has written its record again before
    the check: the light check still finds the loss, and writes back every record the plane lost."""
    from deepxd.actors.messages import Republish

    for name in ("w0", "w1", "w2"):
        await ask(heap, "create", name=name, shape=[2], dtype="float32", owner="alice")
    await heap.ref.ask(Republish(whole=True), timeout=10)  # the checks so far found nothing lost
    names = ["tensor:w0", "tensor:w1", "tensor:w2"]
    await kv.delete(*await kv.keys("*"))  # as a FLUSHDB
    await ask(heap, "attach", name="w0", holder="bob")  # the first tensor's record, written whole again
    assert await kv.missing(names) == ["tensor:w1", "tensor:w2"]
    assert await heap.ref.ask(Republish(whole=False), timeout=10) == 2
    assert not await kv.missing(names)
    assert await heap.ref.ask(Republish(whole=False), timeout=10) == 0  # after a loss, the next check reads all too
    await kv.delete("tensor:w1")  # by hand, one record: the whole check (once in WHOLE_CHECK) writes it again
    assert await heap.ref.ask(Republish(whole=False), timeout=10) == 0
    assert await heap.ref.ask(Republish(whole=True), timeout=10) == 1


async def test_a_lifecycle_command_does_not_cost_the_other_wait_its_connection(redis_server, node):
    """On Redis, a push to one lifecycle list ends that list's wait; the other list's wait goes on (a cancelled
    BLMOVE drops its connection, and a new one is made for the next): commands one at a time, and waits that time
    out together, make no connections."""
    import redis

    from deepxd.kv.redis import RedisKV

    store = RedisKV(redis_server.url, prefix=f"hm{os.getpid()}{node}:")
    await store.connect()
    actor = HeapMemory(store, node)
    actor.start()
    r = redis.Redis.from_url(redis_server.url)
    pack: Callable[[dict[str, Any]], bytes] = msgpack.packb  # type: ignore[assignment]
    try:
        await ask(actor, "list")
        await asyncio.sleep(0.3)  # both waits blocked in the server
        made = int(r.info("stats")["total_connections_received"])
        for i in range(10):
            await store.rpush(LIFECYCLE, pack({"cmd": "create", "name": f"v{i}", "shape": [1], "dtype": "float32"}))

            async def applied(i: int = i) -> bool:
                return f"v{i}" in [t["name"] for t in await ask(actor, "list")]

            await eventually(applied, timeout=10)
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.5)  # idle: the waits end at their timeouts (WAKE_WAIT_S), often together
        assert int(r.info("stats")["total_connections_received"]) - made <= 2
    finally:
        await actor.stop()
        await store.close()
        r.close()
