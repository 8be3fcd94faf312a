"""deepxctl as a whole: --help is instant and light, and an unreachable daemon is one line and exit code 1."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from deepxctl.cli import cli
from tests.daemon.conftest import DEEPXCTL
from tests.deepxctl.conftest import Live, ctl, one_line_error

COMMANDS = [[], ["tensors"], ["tensors", "ls"], ["tensors", "show"], ["tensors", "rm"], ["memory"], ["ops"],
            ["ops", "ls"], ["nodes"], ["nodes", "ls"], ["actors"], ["actors", "ls"], ["graphs"], ["graphs", "ls"],
            ["graphs", "show"], ["top"], ["ir"]]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "deepxctl")
def test_help(args: list[str]) -> None:
    r = CliRunner().invoke(cli, [*args, "--help"])
    assert r.exit_code == 0 and "Usage: " in r.stdout


def test_help_imports_nothing_heavy() -> None:
    """`--help` is instant because the CLI's module imports nothing heavy (bench/startup.py times it)."""
    code = ("import sys; import deepxctl.cli; "
            "print([m for m in ('numpy', 'msgpack', 'rich', 'yaml', 'deepxd', 'deepx_sdk') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
    r = subprocess.run([*DEEPXCTL, "tensors", "ls", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--filter KEY=VALUE" in r.stdout


@pytest.mark.parametrize("args", [["tensors", "ls"], ["tensors", "show", "w"], ["tensors", "rm", "w"], ["memory"],
                                  ["ops", "ls"], ["nodes", "ls"], ["actors", "ls"], ["graphs", "ls"],
                                  ["graphs", "show", "g"], ["top", "--once"], ["ir", "print (tensor:x) -> ()"]],
                         ids=lambda a: " ".join(a))
def test_unreachable_daemon(tmp_path, args: list[str]) -> None:
    address = f"unix://{tmp_path}/nobody.sock"
    msg = one_line_error(ctl("--address", address, *args))
    assert f"cannot reach deepxd at {address}" in msg and "deepxd start" in msg


def test_address_from_the_environment(tmp_path) -> None:
    address = f"unix://{tmp_path}/env.sock"
    r = CliRunner().invoke(cli, ["nodes", "ls"], env={"DEEPX_ADDRESS": address})
    assert address in one_line_error(r)


@pytest.mark.parametrize("address, hint", [("/run/deepx/deepxd.sock", "unix:///run/deepx/deepxd.sock"),
                                           ("http://h:1", "unix:///path/to/deepxd.sock"),
                                           ("udp://127.0.0.1:9090", "unix:///path/to/deepxd.sock")])
def test_an_address_that_is_not_unix_or_tcp_is_a_usage_error(address: str, hint: str) -> None:
    """It said "NativeClient needs a unix:// address" (a class of the SDK's) and exited 1."""
    for r in (ctl("--address", address, "nodes", "ls"), CliRunner().invoke(cli, ["nodes", "ls"],
                                                                           env={"DEEPX_ADDRESS": address})):
        msg = one_line_error(r, code=2)
        assert msg == (f"Error: --address {address!r} is not a daemon address: give its native socket as {hint} "
                       "or its TCP listener as tcp://HOST:PORT (deepxIR over UDP to udp://host:port goes through "
                       "`deepxctl ir --udp HOST:PORT`)")
        assert "NativeClient" not in msg


def test_console_script() -> None:
    r = subprocess.run([*DEEPXCTL, "--address", "unix:///nonexistent/deepxd.sock", "nodes", "ls"],
                       capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("Error: cannot reach deepxd")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["tensors", "ls", "--help"], ["nodes", "ls"],
                                  ["tensors", "ls", "--format", "json"], ["memory"], ["top", "--once"]],
                         ids=lambda a: " ".join(a))
def test_a_reader_gone_before_the_first_write_is_a_quiet_exit_0(live: Live, args: list[str]) -> None:
    """stdout a pipe whose reader has closed: every write fails (EPIPE). click's own handling exits 1, rich's exits
    1, and a BrokenPipeError inside a command read as a lost connection; each is exit 0 with nothing said."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([*DEEPXCTL, "--address", live.daemon.address, *args], stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=60, env={**os.environ, "NO_COLOR": "1"})
    finally:
        os.close(write)
    # nothing said about the pipe (the note of which daemon answered comes before any write)
    assert (r.returncode, [ln for ln in r.stderr.splitlines() if not ln.startswith("from deepxd ")]) == (0, [])


def test_table_cells_are_text_never_markup() -> None:
    """A client names a tensor's owner: '[/x]' made rich raise (a traceback for every operator of the cluster) and
    '[red]alice' printed red. Cells are shown as the text they are."""
    from rich.console import Console

    from deepxctl.schema import Tensor
    from deepxctl.term import make_table

    rows = [Tensor(name="a", kind="heap", dtype="float32", shape=[2], bytes=8, owner="[/x]", node="n1"),
            Tensor(name="[bold]b", kind="heap", dtype="float32", shape=[2], bytes=8, owner="[red]alice", node="n1")]
    out = Console(record=True, width=200, color_system=None)
    out.print(make_table(rows, Tensor, title="tensors [x]"))
    text = out.export_text()
    assert "[/x]" in text and "[red]alice" in text and "[bold]b" in text and "tensors [x]" in text


def test_a_running_node_whose_heartbeat_is_old_shows_as_dead() -> None:
    """A daemon killed with SIGKILL leaves `running` in its record: deepxctl shows `dead` once its heartbeat is more
    than STALE_BEATS heartbeats old (heartbeat_s where the record has it, else 2 s)."""
    from deepxctl.schema import Node

    def state(age: float | None, **raw: object) -> str:
        return Node.from_raw({"node": "n", "state": "running", "heartbeat_age_s": age, **raw}).state

    assert state(1.0) == "running" and state(None) == "running"
    assert state(10.5) == "dead"
    assert state(10.5, heartbeat_s=5) == "running" and state(30, heartbeat_s=5) == "dead"
    assert Node.from_raw({"node": "n", "state": "stopped", "heartbeat_age_s": 999}).state == "stopped"


def test_ctrl_c_while_waiting_exits_130(tmp_path) -> None:
    """docs/deepxctl.md: interrupted, exit 130 (click's own handling printed 'Aborted!' and exited 1)."""
    import signal
    import socket

    path = tmp_path / "mute.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)
    srv.settimeout(30)
    # Python's own SIGINT handling in the child, however this suite was started (a `&` job ignores SIGINT)
    proc = subprocess.Popen([*DEEPXCTL, "--address", f"unix://{path}", "nodes", "ls"],
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        conn, _ = srv.accept()  # connected, waiting for an answer that never comes
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()
    assert proc.returncode == 130, err
    assert "Aborted" not in err and "Traceback" not in err
