"""deepxctl top: one frame, and a few live frames."""

from __future__ import annotations

import os
import signal
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner

from deepx_core.ir import parse_text
from deepxctl.cli import cli
from tests.daemon.conftest import DEEPXCTL
from tests.deepxctl.conftest import Live

IR_LINE = "newtensor (vector<int32>:[1]) -> (tensor<float32>:pipe_t)"


def test_top_once_renders_a_frame(live: Live) -> None:
    r = live.ctl("top", "--once")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.startswith("deepxctl top") and live.node in out
    assert "busiest ops since start" in out and "matmul" in out
    assert "memory by kind" in out and "heap" in out and "stack" in out
    assert "actors (deepest mailbox first)" in out and "MAILBOX" in out and "scheduler" in out


def test_top_live_frames_show_the_last_interval(live: Live) -> None:
    with live.daemon.client() as c:
        c.put("top_in", np.ones((4,), np.float32))
        for _ in range(3):
            c.run(parse_text("exp (tensor:top_in) -> (tensor:top_out)")).raise_for_error()
    r = live.ctl("top", "-n", "3", "--interval", "0.3", "--rows", "3")  # not a terminal: frames one after another
    assert r.exit_code == 0, r.output
    assert r.stdout.count("deepxctl top") == 3
    assert r.stdout.count("busiest ops since start") == 1 and r.stdout.count("busiest ops in the last") == 2


def test_top_refreshes_in_place_on_a_terminal(live: Live) -> None:
    r = CliRunner().invoke(cli, ["--address", live.daemon.address, "top", "-n", "2", "--interval", "0.1"],
                           env={"FORCE_COLOR": "1", "COLUMNS": "150", "LINES": "60"}, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "\x1b[2K" in r.stdout and "\x1b[1A" in r.stdout  # rich.live erased the first frame to draw the second
    assert "busiest ops in the last" in r.stdout


def test_top_needs_a_daemon(live: Live) -> None:
    r = live.ctl("top", "--once", kv=True)
    assert r.exit_code == 1 and "need a running deepxd" in r.stderr


@pytest.mark.parametrize("command", [["top", "-n", "6", "--interval", "0.3"], ["ir", *[IR_LINE] * 3000]],
                         ids=["top", "ir"])
def test_a_reader_that_leaves_early_is_a_quiet_exit_0(live: Live, command: list[str]) -> None:
    """`deepxctl top | head -2` said "Error: lost the connection to deepxd: [Errno 32] Broken pipe" and exited 1:
    BrokenPipeError is a ConnectionError. Every command: `ir`'s reply lines break the pipe the same way."""
    p = subprocess.Popen([*DEEPXCTL, "--address", live.daemon.address, *command], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ, "NO_COLOR": "1"})
    assert p.stdout is not None and p.stderr is not None
    first = p.stdout.readline()
    p.stdout.close()  # head -1 exits: what deepxctl writes next breaks the pipe
    try:
        err = p.stderr.read()
        assert p.wait(60) == 0, err
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
    assert first and err == b""
