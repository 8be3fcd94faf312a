"""deepxctl ops ls, nodes ls and actors ls against a live deepxd."""

from __future__ import annotations

import json
import os
import signal

from tests.deepxctl.conftest import MATMULS, Live, ctl, one_line_error, wait_for


def test_ops_ls_json(live: Live) -> None:
    r = live.ctl("ops", "ls", "--format", "json", "--detail")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [r["total_s"] for r in rows] == sorted((r["total_s"] for r in rows), reverse=True)
    mm = next(r for r in rows if r["op"] == "matmul")
    assert (mm["node"], mm["worker"], mm["calls"]) == (live.node, "op-cpu", MATMULS)
    assert mm["total_s"] > 0
    assert abs(mm["mean_us"] - mm["total_s"] / MATMULS * 1e6) < 1e-3
    assert mm["bytes"] == MATMULS * 16  # a 2x2 float32 result per call
    assert abs(mm["bytes_per_s"] - mm["bytes"] / mm["total_s"]) <= 1e-3 * mm["bytes_per_s"]
    assert list(mm) == ["node", "worker", "op", "calls", "mean_us", "total_s", "bytes_per_s", "bytes"]
    plain = json.loads(live.ctl("ops", "ls", "--format", "json", "--filter", "op=matmul").stdout)
    assert len(plain) == 1 and "bytes" not in plain[0]


def test_ops_ls_table(live: Live) -> None:
    r = live.ctl("ops", "ls", "--filter", "op=matmul")
    assert r.stdout.splitlines()[0].split() == ["NODE", "WORKER", "OP", "CALLS", "MEAN", "(us)", "TOTAL",
                                                "THROUGHPUT"]
    assert f" {MATMULS} " in r.stdout.splitlines()[2]


def test_nodes_ls_json(live: Live) -> None:
    rows = json.loads(live.ctl("nodes", "ls", "--format", "json", "--detail").stdout)
    me = next(n for n in rows if n["node"] == live.node)
    assert me["state"] == "running"
    assert me["roles"] == ["registry", "heapmem", "scheduler", "op-cpu"]
    assert me["addresses"] == {"unix": live.daemon.address, "udp": f"127.0.0.1:{live.daemon.udp_port}"}
    assert 0 <= me["heartbeat_age_s"] < 5
    assert me["devices"] == ["cpu"]
    assert me["pid"] == live.daemon.proc.pid
    assert me["started"] > 1e9
    assert me["blas"] == "numpy" or me["blas"].startswith("mkl 20")  # what op-cpu's matmul runs on
    assert "pid" not in json.loads(live.ctl("nodes", "ls", "--format", "json").stdout)[0]
    table = live.ctl("nodes", "ls").stdout
    assert "HEARTBEAT AGE" in table and live.node in table


def test_actors_ls_json(live: Live) -> None:
    def listing() -> dict[str, dict]:
        return {a["name"]: a for a in json.loads(live.ctl("actors", "ls", "--format", "json", "--detail").stdout)}

    rows = listing()
    assert set(rows) == {"registry", "heapmem", "scheduler", "op-cpu"}
    for name, a in rows.items():
        assert (a["role"], a["state"], a["restarts"]) == (name, "running", 0)
        assert a["device"] == ("cpu" if name == "op-cpu" else "")  # an op worker's, with --detail: where it computes
        assert a["mailbox"] >= 0 and a["errors"] >= 0 and a["busy_s"] >= 0
    assert rows["op-cpu"]["handled"] >= MATMULS
    running = json.loads(live.ctl("actors", "ls", "--format", "json", "--filter", "state!=running").stdout)
    assert running == []
    assert live.ctl("actors", "ls").stdout.splitlines()[0].split() == [
        "NAME", "ROLE", "STATE", "DOING", "FOR", "MAILBOX", "HANDLED", "ERRORS", "RESTARTS"]
    assert "device" not in json.loads(live.ctl("actors", "ls", "--format", "json").stdout)[0]  # (--detail's)
    # what each actor is handling now: the registry answers this very query; the others are idle (heapmem checks
    # the plane's records of its tensors every 2 s, a round trip to Redis that one listing may come in the middle
    # of: a later one finds it done)
    idle = ("heapmem", "scheduler", "op-cpu")

    def at_rest() -> dict[str, dict] | None:
        r = listing()
        return r if all(r[n]["doing"] == "" for n in idle) else None

    rows = wait_for(at_rest, what="a listing with heapmem, the scheduler and op-cpu idle")
    assert rows["registry"]["doing"] == "actors" and 0 <= rows["registry"]["doing_s"] < 60
    assert [(rows[n]["doing"], rows[n]["doing_s"]) for n in idle] == [("", None)] * 3
    # the fields filter as any other: raw in JSON, rendered in the table
    registry = json.loads(live.ctl("actors", "ls", "--format", "json", "--filter", "doing=actors").stdout)
    assert [a["name"] for a in registry] == ["registry"]


def test_a_daemon_that_does_not_answer_in_time_is_a_timeout_not_a_lost_connection(live: Live) -> None:
    """It said "lost the connection ... timed out"; docs/deepxctl.md says "did not answer within --timeout". A stopped
    daemon (SIGSTOP) still accepts the connection (the kernel does) and answers nothing, as a busy one would."""
    assert live.daemon.proc is not None
    os.kill(live.daemon.proc.pid, signal.SIGSTOP)
    try:
        msg = one_line_error(ctl("--address", live.daemon.address, "--timeout", "0.5", "actors", "ls"))
    finally:
        os.kill(live.daemon.proc.pid, signal.SIGCONT)
    assert msg == f"Error: deepxd at {live.daemon.address} did not answer within 0.5 s (--timeout)"
    assert live.ctl("actors", "ls").exit_code == 0
