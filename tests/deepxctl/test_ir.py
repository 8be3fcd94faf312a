"""deepxctl ir: deepxIR lines by hand, over the native socket and over UDP, with the front end's reply lines."""

from __future__ import annotations

import re

import pytest

from deepxctl.cli import cli
from deepxctl.ir import format_reply
from deepxd.net import udp
from tests.deepxctl.conftest import Live, ctl, one_line_error

OK = re.compile(r"^(\d+) ok// recv_at=(\d+) start_at=(\d+) finish_at=(\d+)$")
ERR = re.compile(r"^(\d+) error// recv_at=(\d+) start_at=(\d+) finish_at=(\d+) (.+)$")

LINES = [
    "newtensor (vector<int32>:[2 2]) -> (tensor<float32>:ir_a) // id=11",
    "arange (var<int32>:0, var<int32>:1) -> (tensor<float32>:ir_a) // id=12",
    "this is not deepxIR",
    "print (tensor<float32>:ir_a) -> () // id=14",
    "nosuchop (tensor<float32>:ir_a) -> () // id=15",
    "add (tensor<float32>:ir_a, tensor<float32>:missing) -> (tensor<float32>:ir_b) // id=16",
]


def check_replies(lines: list[str]) -> None:
    assert len(lines) == len(LINES)
    for i in (0, 1, 3):
        m = OK.match(lines[i])
        assert m, lines[i]
        rid, recv, start, finish = map(int, m.groups())
        assert rid == 11 + i and recv > 1.7e12 and 0 < start <= finish
    m = ERR.match(lines[2])
    assert m and m.group(1) == "0" and m.group(3) == "0"
    m = ERR.match(lines[4])
    assert m and m.group(1) == "15" and m.group(3) == "0" and m.group(5) == "op 'nosuchop' not found"
    m = ERR.match(lines[5])
    assert m and m.group(1) == "16" and "missing" in m.group(5) and not m.group(5).startswith("instruction")


@pytest.mark.parametrize("over", ["native", "udp"])
def test_ir_lines(live: Live, over: str) -> None:
    extra = ["--udp", f"127.0.0.1:{live.daemon.udp_port}"] if over == "udp" else []
    if over == "udp":  # the native run's ir_a is not UDP's: UDP clients reach only what they made or were shared
        live.ctl("tensors", "rm", "ir_a")
    r = live.ctl("ir", *extra, *LINES)
    assert r.exit_code == 1  # some lines failed
    check_replies(r.stdout.splitlines())
    if over == "native":
        assert "ir_a float32[2, 2]" in r.stderr  # the print instruction's output


def test_ir_file_and_stdin(live: Live, tmp_path) -> None:
    script = tmp_path / "script.dxir"
    script.write_text("\n".join(LINES[:2]) + "\n\n")
    r = live.ctl("ir", "-f", str(script))
    assert r.exit_code == 0, r.output
    assert [OK.match(x).group(1) for x in r.stdout.splitlines()] == ["11", "12"]
    from click.testing import CliRunner

    r = CliRunner().invoke(cli, ["--address", live.daemon.address, "ir", "-f", "-"], input=LINES[3] + "\n")
    assert r.exit_code == 0 and OK.match(r.stdout.strip())


def test_ir_refusals(live: Live) -> None:
    one_line_error(live.ctl("ir"), code=2)
    one_line_error(live.ctl("ir", "--udp", "nohostport", LINES[0]), code=2)
    msg = one_line_error(ctl("--address", live.daemon.address, "--timeout", "0.3", "ir", "--udp", "127.0.0.1:9",
                             LINES[0]))
    assert "no reply from udp://127.0.0.1:9" in msg


@pytest.mark.parametrize("args", [(7, True, 1, 2, 3, ""), (0, False, 5, 0, 6, "bad\nline  here"),
                                  (1, False, 1, 1, 1, "x" * 70000), (2, False, 1, 1, 1, "é" * 40000),
                                  (3, False, 1, 1, 1, "x" * 65430 + "€" * 20)])
def test_reply_format_is_the_udp_transports(args) -> None:
    assert format_reply(*args) == udp.format_reply(*args)


def test_a_line_whose_number_cannot_go_on_the_wire_fails_alone(live: Live) -> None:
    """Over the native socket an int beyond 64 bits cannot be encoded: that line's reply says so, naming the op,
    and the lines after it run (they had no reply at all, and the error named neither)."""
    lines = ["newtensor (vector<int32>:[2]) -> (tensor<int32>:ir_big) // id=21",
             "addscalar (tensor<int32>:ir_big, var<int32>:99999999999999999999999) -> (tensor<int32>:ir_big) // id=22",
             "print (tensor<int32>:ir_big) -> () // id=23"]
    r = live.ctl("ir", *lines)
    assert r.exit_code == 1
    out = r.stdout.splitlines()
    assert len(out) == 3 and OK.match(out[0]) and OK.match(out[2])
    m = ERR.match(out[1])
    assert m and m.group(1) == "22" and m.group(5).startswith("addscalar: value 99999999999999999999999 does not fit")
