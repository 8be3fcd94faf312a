"""deepxIR text over UDP, as the existing deepx front end speaks it (docs/deepxir.md sections 2 and 3).

One datagram carries one or more `\\n`-separated instruction lines; each line runs eagerly, in order, as a
one-instruction program, and gets exactly one reply datagram, sent to the sender's address:

    <id> ok// recv_at=<ms> start_at=<ms> finish_at=<ms>
    <id> error// recv_at=<ms> start_at=<ms> finish_at=<ms> <message>

A line that does not parse, is not UTF-8 or names an unknown op still gets its reply (each line is decoded on its
own, so one bad byte costs only its line); a reply too long for one datagram has its message cut to fit; a bad
datagram never stops the server.

UDP carries no credentials, so its clients reach only the tensors UDP made and those shared with it: the
scheduler checks each line against deepxd/access.py's UdpScope (docs/daemon.md, "who can do what"). Its work is
budgeted: a turn of the loop runs at most TURN_LINES lines or TURN_S seconds of one sender's datagrams, senders take
turns, and backlogs are capped (per sender and in all), so that a flood never starves the native socket or the other
senders.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import re
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import request_id
from deepx_core.ir.text import parse_line
from deepxd.actors.messages import Run
from deepxd.actors.worker import RunResult
from deepxd.net.reply import format_reply

if TYPE_CHECKING:
    from deepxd.node import Node

log = logging.getLogger(__name__)

_ID = re.compile(r"(?:^|\s)id=(\S*)")

TURN_LINES = 64  # lines of one sender run in one turn of the event loop, at most
TURN_S = 0.002  # and at most this long, before the loop serves others (the native socket, other senders)
BACKLOG_BYTES = 8 << 20  # a sender's datagrams waiting beyond this are dropped (as a full socket buffer would)
TOTAL_BACKLOG_BYTES = 64 << 20  # and all senders' together: memory stays bounded however many ports send


def _request_id(line: str) -> int:
    """The `id=` of a line that did not parse, read as Instr.id reads a parsed one's: a key of its own after the
    first `//` (one search, in time linear in the line)."""
    at = line.find("//")
    m = _ID.search(line[at + 2:]) if at >= 0 else None
    return request_id(m.group(1) if m else None)


def _ms(t: float) -> int:
    return int(t * 1000)


class _Datagram:
    """One received datagram, run a turn's worth of lines at a time."""

    __slots__ = ("addr", "lines", "recv", "size")

    def __init__(self, data: bytes, addr: tuple[str, int], recv: float) -> None:
        self.addr = addr
        self.recv = recv
        self.size = len(data)
        self.lines = _split(data)


def _split(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(line number, offset in the datagram, raw bytes) of each line."""
    offset = 0
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        yield lineno, offset, raw
        offset += len(raw) + 1


class UdpServer(asyncio.DatagramProtocol):
    def __init__(self, node: Node) -> None:
        self.node = node
        self.backlog: dict[tuple[str, int], deque[_Datagram]] = {}  # by sender (address, port), in turn order
        self.backlog_bytes: dict[tuple[str, int], int] = {}
        self.waiting = 0  # bytes of every sender's datagrams waiting
        self.wake = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.transport: asyncio.DatagramTransport | None = None
        self.worker: asyncio.Task[None] | None = None
        self.lines = 0
        self.dropped = 0  # datagrams dropped for a sender's backlog over BACKLOG_BYTES
        self._dropped_said = 0.0
        self.accepting = True
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.worker = asyncio.get_running_loop().create_task(self._work(), name="udp:deepxir")

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if not self.accepting:
            return
        held = self.backlog_bytes.get(addr, 0)
        if held + len(data) > BACKLOG_BYTES or self.waiting + len(data) > TOTAL_BACKLOG_BYTES:
            self.dropped += 1
            now = time.monotonic()
            if now - self._dropped_said > 10:
                self._dropped_said = now
                log.warning("udp: %s sends faster than its lines run: dropped a datagram (%d dropped so far; a "
                            "sender may have %d MiB waiting, all senders %d MiB)", addr, self.dropped,
                            BACKLOG_BYTES >> 20, TOTAL_BACKLOG_BYTES >> 20)
            return
        self.backlog.setdefault(addr, deque()).append(_Datagram(data, addr, time.time()))
        self.backlog_bytes[addr] = held + len(data)
        self.waiting += len(data)
        self.wake.set()

    def error_received(self, exc: Exception) -> None:
        if isinstance(exc, ConnectionRefusedError):  # a sender that left before its reply (ICMP port unreachable)
            log.debug("udp: %s", exc)
        else:
            log.warning("udp: a reply was not sent: %s", exc)

    def pause_writing(self) -> None:  # replies pile up in the transport: run no more lines until they drain
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    async def _work(self) -> None:
        while True:
            if not self.backlog:
                if self.closing:
                    return
                self.wake.clear()
                await self.wake.wait()
                continue
            await self.writable.wait()
            addr = next(iter(self.backlog))
            queue = self.backlog.pop(addr)  # popped and put back at the end: senders take turns
            item = queue[0]
            try:
                finished = await self._turn(item)
            except Exception:
                log.exception("udp: datagram from %s failed", item.addr)
                finished = True
            if finished:
                queue.popleft()
                self.backlog_bytes[addr] -= item.size
                self.waiting -= item.size
            if queue:
                self.backlog[addr] = queue
            else:
                self.backlog_bytes.pop(addr, None)
            await asyncio.sleep(0)  # the loop's other work (the native socket) runs between turns

    async def _turn(self, item: _Datagram) -> bool:
        """Run up to a turn's budget of the datagram's lines; True once it has no lines left."""
        deadline = time.perf_counter() + TURN_S
        for n, (lineno, start, raw) in enumerate(item.lines, 1):
            await self._line(lineno, start, raw, item.addr, item.recv)
            if n >= TURN_LINES or time.perf_counter() > deadline:
                return False
        return True

    async def _line(self, lineno: int, start: int, raw: bytes, addr: tuple[str, int], recv: float) -> None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # this line's reply; the others run
            self.lines += 1
            rid = _request_id(raw.decode("utf-8", "replace"))
            self._send(format_reply(rid, False, _ms(recv), 0, _ms(time.time()),
                                    f"line {lineno} is not UTF-8 text: byte {e.start} of the line (byte "
                                    f"{start + e.start} of the datagram) is {raw[e.start]:#04x}"), addr)
            return
        if not line.strip():
            return
        self.lines += 1
        try:
            instr = parse_line(line.rstrip("\r"), lineno)
        except DeepxError as e:
            self._send(format_reply(_request_id(line), False, _ms(recv), 0, _ms(time.time()), str(e)), addr)
            return
        rid = instr.id
        try:  # origin udp: the scheduler checks what the line may name (deepxd/access.py) as it runs it
            result: RunResult = await self.node.ref("scheduler").ask(Run(program=[instr], fetch=[], origin="udp"))
        except DeepxError as e:
            self._send(format_reply(rid, False, _ms(recv), 0, _ms(time.time()), str(e)), addr)
            return
        if result.times_us:
            begin = _ms(result.t0 + result.times_us[0] / 1e6)
            finish = _ms(result.t0 + result.times_us[-1] / 1e6)
        elif result.failed_at >= 0:  # it started, and failed while running (a division by zero)
            begin, finish = _ms(result.t0 + result.failed_at / 1e6), _ms(time.time())
        else:
            begin, finish = 0, _ms(time.time())
        error = result.error.removeprefix("instruction 1: ")
        self._send(format_reply(rid, not result.error, _ms(recv), begin, finish, error), addr)

    def _send(self, reply: str, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(reply.encode("utf-8", "replace"), addr)  # fits: format_reply cut it

    async def stop_accepting(self) -> None:
        self.accepting = False

    async def close(self) -> None:
        self.closing = True
        self.wake.set()
        self.writable.set()
        if self.worker is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.worker, 5)
        if self.transport is not None:
            self.transport.close()

    def force_close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def start_udp(node: Node, host: str, port: int) -> UdpServer:
    loop = asyncio.get_running_loop()
    try:
        _, protocol = await loop.create_datagram_endpoint(lambda: UdpServer(node), local_addr=(host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE or "could not bind" in str(e):
            # a second daemon on one machine meets the first on the default port: name the ways out
            raise DeepxError(f"cannot listen on udp://{host}:{port}: the port is in use (another deepxd?); start with "
                             f"--udp off (no deepxIR over UDP), --udp {host}:0 (a free port) or --udp {host}:PORT "
                             "(DEEPX_UDP, or udp in the config file)") from None
        raise DeepxError(f"cannot listen on udp://{host}:{port}: {e.strerror or e}") from None
    sock = protocol.transport.get_extra_info("socket") if protocol.transport else None
    if sock is not None:
        import socket

        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return protocol
