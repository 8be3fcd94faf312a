"""deepxctl ir: send deepxIR lines to a daemon by hand, and print each reply as the deepxIR front end gets it:

    <id> ok// recv_at=<ms> start_at=<ms> finish_at=<ms>
    <id> error// recv_at=<ms> start_at=<ms> finish_at=<ms> <message>

Over the native socket each line runs as a one-instruction program (recv_at is when deepxctl sent it, start_at and
finish_at when the worker ran it); with --udp the lines go over UDP and the daemon's reply datagrams are printed as
they come.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterable
from typing import IO

import click

from deepxctl.context import Ctl
from deepxctl.term import CtlError, display_note

_ID = re.compile(r"//.*?\bid=(\d+)")


def format_reply(rid: int, ok: bool, recv_ms: int, start_ms: int, finish_ms: int, message: str = "") -> str:
    """One reply line, exactly as deepxd's UDP transport writes it: its own function (deepxd/net/reply.py), imported
    when a line is answered, not when deepxctl starts."""
    from deepxd.net.reply import format_reply as reply

    return reply(rid, ok, recv_ms, start_ms, finish_ms, message)


def _ms(t: float) -> int:
    return int(t * 1000)


def read_lines(args: Iterable[str], file: IO[str] | None) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line: the arguments first (one may hold several lines), then the
    file."""
    text = "\n".join(args)
    if file is not None:
        text = (text + "\n" if text else "") + file.read()
    return [(n, ln.rstrip("\r")) for n, ln in enumerate(text.split("\n"), 1) if ln.strip()]


def run_native(ctl: Ctl, lines: list[tuple[int, str]]) -> bool:
    from deepx_core.errors import DeepxError
    from deepx_core.ir.text import parse_line
    from deepx_core.ir.wire import pack_instr_cached

    client = ctl.daemon("ir").client
    ok_all = True
    for lineno, line in lines:
        recv = time.time()
        m = _ID.search(line)
        rid = int(m.group(1)) if m else 0
        try:
            instr = parse_line(line, lineno)
        except DeepxError as e:
            click.echo(format_reply(rid, False, _ms(recv), 0, _ms(time.time()), str(e)))
            ok_all = False
            continue
        try:
            pack_instr_cached(instr)  # what cannot go on the wire (an int beyond 64 bits) fails this line alone
        except DeepxError as e:
            click.echo(format_reply(instr.id, False, _ms(recv), 0, _ms(time.time()), str(e)))
            ok_all = False
            continue
        reply = client.run([instr])
        for out in reply.output:
            click.echo(out, err=True)
        if len(reply.times_us):
            start, finish = reply.t0 + reply.times_us[0, 0] / 1e6, reply.t0 + reply.times_us[-1, 1] / 1e6
            start_ms, finish_ms = _ms(start), _ms(finish)
        else:
            start_ms, finish_ms = 0, _ms(time.time())
        error = (reply.error or "").removeprefix("instruction 1: ")
        click.echo(format_reply(instr.id, reply.ok, _ms(recv), start_ms, finish_ms, error))
        ok_all &= reply.ok
    return ok_all


def udp_target(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    try:
        p = int(port)
        if not 0 < p < 65536 or not host:
            raise ValueError
    except ValueError:
        raise CtlError(f"--udp {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9090", exit_code=2) from None
    return host.strip("[]"), p


def run_udp(target: str, lines: list[tuple[int, str]], timeout: float) -> bool:
    from deepxd.net.reply import MAX_DATAGRAM

    host, port = udp_target(target)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
    except OSError as e:
        raise CtlError(f"--udp {target}: cannot resolve {host!r}: {e}") from None
    ok_all = True
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        for _, line in lines:
            data = line.encode("utf-8")
            if len(data) > MAX_DATAGRAM:
                raise CtlError(f"a line of {len(data)} bytes does not fit in one datagram ({MAX_DATAGRAM})")
            try:
                s.sendto(data, (host, port))
                reply = s.recvfrom(MAX_DATAGRAM + 1)[0].decode("utf-8", "replace")
            except TimeoutError:
                raise CtlError(f"no reply from udp://{host}:{port} within {timeout} s; is deepxd listening there "
                               "(deepxd start --udp HOST:PORT)?") from None
            except OSError as e:
                raise CtlError(f"udp://{host}:{port}: {e.strerror or e}") from None
            click.echo(reply)
            ok_all &= " ok// " in reply
    return ok_all


@click.command("ir")
@click.argument("lines", nargs=-1)
@click.option("-f", "--file", "file", type=click.File("r"), help="Read deepxIR lines from FILE (- for stdin).")
@click.option("--udp", metavar="HOST:PORT", help="Send over UDP to HOST:PORT instead of the native socket.")
@click.pass_obj
def ir(ctl: Ctl, lines: tuple[str, ...], file: IO[str] | None, udp: str | None) -> None:
    """Send deepxIR lines and print one reply line per instruction; the exit code is 1 when any failed. Output of
    print instructions goes to stderr (over the native socket; over UDP it goes to the daemon's log).

    \b
      deepxctl ir "newtensor (vector<int32>:[2 3]) -> (tensor<float32>:a) // id=1" \\
                  "arange (var<int32>:0, var<int32>:1) -> (tensor<float32>:a) // id=2"
      deepxctl ir -f script.dxir
      deepxctl ir --udp 127.0.0.1:9090 -f script.dxir
    """
    todo = read_lines(lines, file)
    if not todo:
        raise CtlError("ir: no instructions; give deepxIR lines as arguments or -f FILE", exit_code=2)
    if udp:
        if ctl.kv:
            raise CtlError("ir sends instructions to a daemon; --kv does not reach one")
        ok = run_udp(udp, todo, ctl.timeout)
    else:
        ok = run_native(ctl, todo)
    if not ok:
        display_note("some instructions failed")
        click.get_current_context().exit(1)
