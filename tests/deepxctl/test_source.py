"""Which daemon answered (issue 27, item 4), the op catalogue without a daemon (item 5), `top --format json` and
`python -m deepxd` (item 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from deepx_core.ir.ops import OPS
from deepxctl.cli import cli
from tests.daemon.conftest import DEEPXD, Daemon
from tests.deepxctl.conftest import Live, ctl


def test_every_listing_says_which_daemon_answered(live: Live) -> None:
    """node, pid and socket on stderr above each listing, in any format: stdout stays the table or the list."""
    said = f"from deepxd {live.node} (pid {live.daemon.proc.pid}) at {live.daemon.address}\n"
    for args in (["tensors", "ls"], ["nodes", "ls", "--format", "json"], ["memory", "--format", "yaml"],
                 ["actors", "ls"], ["tensors", "show", "w"]):
        r = live.ctl(*args)
        assert r.exit_code == 0 and r.stderr.startswith(said), (args, r.stderr)
        assert said not in r.stdout
    assert isinstance(json.loads(live.ctl("tensors", "ls", "--format", "json").stdout), list)
    r = live.ctl("tensors", "ls", kv=True)
    assert r.stderr.startswith("from the storage plane at redis://") and "(--kv: no daemon asked)" in r.stderr


def test_the_default_socket_is_named_as_such(tmp_path: Path) -> None:
    """deepxctl with no --address reaches whoever owns the default socket: the note says it was the default."""
    xdg = tmp_path / "xdg"
    (xdg / "deepx").mkdir(parents=True, mode=0o700)
    d = Daemon(xdg / "deepx", udp=False).start()
    try:
        env = {"XDG_RUNTIME_DIR": str(xdg), "DEEPX_ADDRESS": None}
        r = CliRunner(env=env).invoke(cli, ["nodes", "ls"], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert (f"from deepxd {d.node_id} (pid {d.proc.pid}) at unix://{xdg}/deepx/deepxd.sock (the default socket; "
                "--address or DEEPX_ADDRESS picks another)") in r.stderr
        chosen = CliRunner(env=env).invoke(cli, ["--address", d.address, "nodes", "ls"], catch_exceptions=False)
        assert "default socket" not in chosen.stderr
    finally:
        assert d.stop() == 0, d.output()


def test_the_op_catalogue_needs_no_daemon() -> None:
    """`deepxctl ops catalogue`, which DeepxAttributeError names for the ops there are."""
    import deepx_sdk as dx

    rows = json.loads(ctl("--address", "unix:///nonexistent/d.sock", "ops", "catalogue", "--format", "json",
                          "--detail", "--limit", "1000").stdout)
    assert [r["name"] for r in rows] == sorted(OPS)
    relu = next(r for r in rows if r["name"] == "relu")
    assert relu["grad"] is True and relu["family"] == OPS["relu"].family and relu["signature"].startswith("relu(")
    try:
        dx.zeros(2).mode(0)
    except dx.DeepxError as e:
        assert "`deepxctl ops catalogue` lists the ops" in str(e)
    else:
        raise AssertionError("Tensor.mode exists")


def test_top_prints_json_lines(live: Live) -> None:
    r = live.ctl("top", "--format", "json", "-n", "2", "--interval", "0.05")
    frames = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.exit_code == 0 and len(frames) == 2
    first, second = frames
    assert (first["node"], first["pid"], first["address"]) == (live.node, live.daemon.proc.pid, live.daemon.address)
    assert first["ops_title"] == "busiest ops since start" and "matmul" in {o["op"] for o in first["ops"]}
    assert second["ops_title"].startswith("busiest ops in the last")
    assert {a["name"] for a in first["actors"]} >= {"registry", "scheduler", "op-cpu", "heapmem"}
    once = live.ctl("top", "--format", "json", "--once").stdout.splitlines()
    assert len(once) == 1 and json.loads(once[0])["tensors"] == first["tensors"]


def test_python_dash_m_deepxd() -> None:
    r = subprocess.run([*DEEPXD, "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode == 0 and "start" in r.stdout, r.stderr
    assert DEEPXD[0] == sys.executable
