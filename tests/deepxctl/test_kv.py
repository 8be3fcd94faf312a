"""deepxctl --kv: the storage plane read directly, for a cluster whose daemon is stopped (and a running one's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from deepx_core.identity import this_process
from deepx_core.ir import parse_text
from deepx_core.ir.wire import pack_program
from tests.daemon.conftest import Daemon
from tests.deepxctl.conftest import ME, Live, ctl, one_line_error, wait_for


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, bytes]:
    """A plane file written by a deepxd that then stopped: heap tensors, its node entry, op counters."""
    tmp = tmp_path_factory.mktemp("stopped")
    url = f"memory://{tmp}/plane.aof"
    d = Daemon(tmp, kv=url, udp=False).start()
    try:
        with d.client() as c:
            c.put("weights", np.ones((8, 8), np.float32), heap=True, owner="trainer")
            c.put("bias", np.zeros((8,), np.float32), heap=True)
            c.put("scratch", np.zeros((8,), np.float32))
            for _ in range(3):
                c.run(parse_text("add (tensor:bias, tensor:bias) -> (tensor:scratch)")).raise_for_error()
            wait_for(lambda: any(r["op"] == "add" and r["calls"] == 3 for r in c.admin("ops")), what="op counters")
    finally:
        assert d.stop() == 0, d.output()
    return url, d.node_id, Path(tmp / "plane.aof").read_bytes()


def kv_json(url: str, *args: str) -> list | dict:
    r = ctl("--kv", url, *args, "--format", "json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_tensors_of_a_stopped_daemon(stopped) -> None:
    url, node, _ = stopped
    rows = {t["name"]: t for t in kv_json(url, "tensors", "ls", "--detail")}
    assert set(rows) == {"weights", "bias"}  # stack tensors died with the daemon
    w = rows["weights"]
    assert (w["kind"], w["dtype"], w["shape"], w["bytes"], w["owner"], w["node"]) == (
        "heap", "float32", [8, 8], 256, "trainer", node)
    assert (w["state"], w["refcount"], w["holders"]) == ("stopped", 1, ["trainer"])
    heap = kv_json(url, "tensors", "ls", "--filter", f"owner={ME}")  # the session that put it, as its record says
    assert [t["name"] for t in heap] == ["bias"]
    assert (rows["bias"]["pid"], rows["bias"]["client"]) == (os.getpid(), this_process()["name"])
    shown = kv_json(url, "tensors", "show", "weights")
    assert shown["preview"] is None and "values need a running deepxd" in shown["note"]
    assert "no tensor named 'nope' in the storage plane" in one_line_error(ctl("--kv", url, "tensors", "show", "nope"))


def test_nodes_ops_memory_graphs_of_a_stopped_daemon(stopped) -> None:
    url, node, _ = stopped
    (n,) = kv_json(url, "nodes", "ls", "--detail")
    assert (n["node"], n["state"], n["roles"], n["devices"]) == (node, "stopped", [
        "registry", "heapmem", "scheduler", "op-cpu"], ["cpu"])
    assert n["heartbeat_age_s"] >= 0 and n["pid"] > 0 and "udp" not in n["addresses"]
    add = next(o for o in kv_json(url, "ops", "ls") if o["op"] == "add")
    assert (add["node"], add["worker"], add["calls"]) == (node, "op-cpu", 3) and add["total_s"] > 0
    m = kv_json(url, "memory")
    assert m["total_bytes"] == 256 + 32 and m["heapmem"] is None
    assert {u["name"]: u["bytes"] for u in m["by_owner"]} == {"trainer": 256, ME: 32}
    assert kv_json(url, "graphs", "ls") == []
    assert "no graph named 'g'" in one_line_error(ctl("--kv", url, "graphs", "show", "g"))


def test_reading_leaves_the_file_alone(stopped) -> None:
    url, _, before = stopped
    path = Path(url.removeprefix("memory://"))
    for args in (["tensors", "ls"], ["nodes", "ls"], ["ops", "ls"], ["graphs", "ls"], ["memory"]):
        assert ctl("--kv", url, *args).exit_code == 0
    assert path.read_bytes() == before


def test_daemon_only_commands_refuse_under_kv(stopped) -> None:
    url, _, _ = stopped
    for args in (["actors", "ls"], ["top", "--once"], ["tensors", "rm", "bias"], ["ir", "print (tensor:x) -> ()"]):
        assert "need a running deepxd" in one_line_error(ctl("--kv", url, *args)), args


def test_bad_planes(tmp_path: Path) -> None:
    assert "no storage file" in one_line_error(ctl("--kv", f"memory://{tmp_path}/none.aof", "tensors", "ls"))
    assert not (tmp_path / "none.aof").exists()
    (tmp_path / "junk").write_bytes(b"hello")
    assert "not a deepx storage file" in one_line_error(ctl("--kv", f"memory://{tmp_path}/junk", "nodes", "ls"))
    assert "inside one daemon" in one_line_error(ctl("--kv", "memory", "nodes", "ls"))
    assert "absolute path" in one_line_error(ctl("--kv", "memory://host/x", "nodes", "ls"))
    assert "unknown storage plane URL" in one_line_error(ctl("--kv", "ftp://x", "nodes", "ls"))


def test_graphs_in_a_plane_file(tmp_path: Path) -> None:
    import asyncio

    from deepxd.kv.memory import MemoryKV

    url = f"memory://{tmp_path}/g.aof"

    async def write() -> None:
        async with MemoryKV(url, prefix="deepx:") as kv:
            await kv.set("graph:step", pack_program(parse_text("exp (tensor:a) -> (tensor:b)")))

    asyncio.run(write())
    (g,) = kv_json(url, "graphs", "ls")
    assert (g["name"], g["instructions"], g["ops"]) == ("step", 1, ["exp"])
    assert kv_json(url, "graphs", "show", "step")["before"] == ["exp (tensor:a) -> (tensor:b)"]


def test_redis_plane_of_a_running_daemon(live: Live) -> None:
    rows = {t["name"]: t for t in json.loads(live.ctl("tensors", "ls", "--format", "json", kv=True).stdout)}
    assert {"w", "v"} <= set(rows) and "x" not in rows  # only heap tensors are in the plane
    assert rows["w"] == {"name": "w", "kind": "heap", "dtype": "float32", "shape": [3, 2], "bytes": 24,
                         "owner": ME, "parameter": "", "call_site": "", "node": live.node}
    nodes = json.loads(live.ctl("nodes", "ls", "--format", "json", kv=True).stdout)
    assert [n["state"] for n in nodes if n["node"] == live.node] == ["running"]
    ops = json.loads(live.ctl("ops", "ls", "--format", "json", "--filter", "op=matmul", kv=True).stdout)
    daemon_ops = json.loads(live.ctl("ops", "ls", "--format", "json", "--filter", "op=matmul").stdout)
    assert ops == daemon_ops
