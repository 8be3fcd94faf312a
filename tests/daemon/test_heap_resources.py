"""Heap tensors against a real deepxd: shared memory reserved up front (a tensor beyond /dev/shm is refused, never a
SIGBUS), no descriptor per tensor, and the segments of killed daemons and sessions removed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from deepx_core.ir import parse_text
from deepxd.shm import list_segments, pid_alive
from tests.daemon.conftest import Daemon, eventually, udp_exchange

ROOT = Path(__file__).resolve().parents[2]
TB_ELEMENTS = 1 << 38  # float32: 1 TiB


def heap_row(c, name: str) -> dict | None:
    return next((t for t in c.admin("tensors") if t["name"] == name and t["kind"] == "heap"), None)


def test_a_heap_tensor_beyond_shared_memory_is_refused_naming_it_over_udp_and_native(daemon: Daemon):
    line = f"newtensor (vector<int32>:[{TB_ELEMENTS}]) -> (tensor<float32>:huge) // kind=heap id=7"
    [reply] = udp_exchange(daemon.udp_port, line, 1)
    assert reply.startswith("7 error//"), reply
    assert "'huge'" in reply and f"{TB_ELEMENTS * 4} bytes" in reply and re.search(r"\d+ bytes are free", reply)
    with daemon.client() as c:
        r = c.run(parse_text(line), fetch=[])
        assert r.error and "'huge'" in r.error and f"{TB_ELEMENTS * 4} bytes" in r.error, r.error
        assert heap_row(c, "huge") is None
        c.ping()
    node = re.sub(r"[^A-Za-z0-9._-]", "_", daemon.node_id)
    assert list_segments(f"deepx-{node}-") == []  # nothing reserved, nothing left
    assert daemon.proc is not None and daemon.proc.poll() is None


def _in_private_shm(args: list[str], size: str) -> list[str]:
    """`args` run as root of a user namespace with its own tmpfs of `size` on /dev/shm."""
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", *args]


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(_in_private_shm(["true"], "1m"), capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="no user and mount namespaces here (unshare -Urm) for a small tmpfs")
def test_filling_a_small_dev_shm_is_refused_and_every_tensor_made_can_be_written(tmp_path):
    d = Daemon(tmp_path)
    d.args = _in_private_shm(d.args, "64m")
    d.start()
    try:
        made, refused = [], None
        mib16 = 4 << 20  # float32 elements
        with d.client() as c:
            for i in range(8):
                r = c.run(parse_text(f"newtensor (vector<int32>:[{mib16}]) -> (tensor<float32>:t{i}) // kind=heap"))
                if r.error:
                    refused = r.error
                    break
                made.append(f"t{i}")
            assert 2 <= len(made) <= 4 and refused is not None, (made, refused)
            assert f"'t{len(made)}'" in refused and f"{mib16 * 4} bytes" in refused and "free" in refused
            # every tensor that was made is backed: filling them all cannot fault (the old sparse segments did)
            for name in made:
                c.put(name, np.full(mib16, 3.0, np.float32), heap=True)
            got = c.fetch(*made)
            assert all(float(got[n].sum()) == 3.0 * mib16 for n in made)
            c.ping()
        assert d.proc is not None and d.proc.poll() is None
    finally:
        assert d.stop() == 0, d.output()


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not shutil.which("prlimit") or not os.path.isdir("/proc/self/fd"), reason="needs prlimit, /proc")
def test_thousands_of_heap_tensors_keep_no_descriptor_each(tmp_path):
    d = Daemon(tmp_path)
    d.args = ["prlimit", "--nofile=256:256", *d.args]  # prlimit execs the daemon: the same pid
    d.start()
    try:
        assert d.proc is not None
        with d.client() as c:
            base = _fd_count(d.proc.pid)
            one = np.arange(4, dtype=np.float32)
            for i in range(3000):
                c.put(f"h{i}", one + i, heap=True)
            assert _fd_count(d.proc.pid) < base + 20
            assert heap_row(c, "h2999")["refcount"] == 1
            assert c.fetch("h1234")["h1234"].tolist() == [1234.0, 1235.0, 1236.0, 1237.0]
        clients = [d.client() for _ in range(20)]  # new connections still open
        for cl in clients:
            cl.ping()
            cl.close()
    finally:
        assert d.stop() == 0, d.output()


def _node_segments(node: str) -> list[str]:
    return list_segments(f"deepx-{re.sub(r'[^A-Za-z0-9._-]', '_', node)}-")


def test_a_restart_after_kill_9_removes_the_orphans_and_deepxctl_lists_and_cleans_others(tmp_path):
    from click.testing import CliRunner

    from deepxctl.cli import cli as main

    d = Daemon(tmp_path)  # an in-memory plane: the records die with the daemon, the segments would not
    d.start()
    with d.client() as c:
        for i in range(3):
            c.put(f"w{i}", np.ones(1000, np.float32), heap=True)
    left = _node_segments(d.node_id)
    assert len(left) == 3
    d.stop(signal.SIGKILL)
    assert _node_segments(d.node_id) == left  # what a kill -9 leaves

    # another, unrelated dead process's segment: listed as an orphan by deepxctl, not removed by the daemon
    stray = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from deepxd.shm import Segment, segment_name
        s = Segment.create(segment_name("elsewhere"), 8192)
        print(s.name)
    """)], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60,
        check=True).stdout.strip()
    try:
        d2 = Daemon(tmp_path, node_id=d.node_id)
        d2.start()
        try:
            assert _node_segments(d.node_id) == []
            assert all(f"unlinked segment {n}" in d2.output() for n in left)
            with d2.client() as c:
                c.put("live", np.ones(10, np.float32), heap=True)
            runner = CliRunner()
            r = runner.invoke(main, ["--address", d2.address, "memory", "--format", "json"])
            assert r.exit_code == 0, r.output
            orphans = json.loads(r.stdout)["orphans"]  # (stderr says which daemon answered)
            assert [o["name"] for o in orphans if o["name"] == stray] == [stray]
            row = next(o for o in orphans if o["name"] == stray)
            assert row["bytes"] == 8192 and row["node"] == "elsewhere" and not pid_alive(row["pid"])
            assert not any(o["name"] in _node_segments(d.node_id) for o in orphans)  # a live daemon's: never
            r = runner.invoke(main, ["--address", d2.address, "memory", "clean"])
            assert r.exit_code == 0, r.output
            assert stray in r.output and stray not in list_segments("deepx-elsewhere-")
            assert len(_node_segments(d.node_id)) == 1  # the live tensor's segment stays
            with d2.client() as c:
                assert c.fetch("live")["live"].sum() == 10
        finally:
            assert d2.stop() == 0, d2.output()
    finally:
        if stray in list_segments("deepx-elsewhere-"):
            os.unlink(f"/dev/shm/{stray}")


def test_a_killed_embedded_session_leaves_segments_that_the_next_daemon_removes(tmp_path):
    code = textwrap.dedent("""
        import sys, numpy as np
        import deepx_sdk as dx
        s = dx.connect()
        s.transport.put("emb", np.ones(2000, np.float32), heap=True)
        print("ready", flush=True)
        sys.stdin.read()
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DEEPX_ROLES": "registry,heapmem,scheduler,op-cpu"}
    env.pop("DEEPX_ADDRESS", None)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env, cwd=tmp_path)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        mine = _node_segments(f"embedded-{p.pid}")
        assert len(mine) == 1
    finally:
        p.kill()
        p.wait()
    assert _node_segments(f"embedded-{p.pid}") == mine  # a kill -9 leaves it
    d = Daemon(tmp_path).start()
    try:
        # (by this daemon, or by any other that started meanwhile: each removes a dead session's segments)
        eventually(lambda: _node_segments(f"embedded-{p.pid}") == [], 10, "the dead session's segment removed")
    finally:
        assert d.stop() == 0, d.output()
