"""deepxIR text over UDP, as the existing deepx front end speaks it (deepxir.md sections 2 and 3).

One datagram carries one or more `\\n`-separated instruction lines; each line runs eagerly, in order, as a
one-instruction program, and gets exactly one reply datagram, sent to the sender's address:

    <id> ok// recv_at=<ms> start_at=<ms> finish_at=<ms>
    <id> error// recv_at=<ms> start_at=<ms> finish_at=<ms> <message>

A line that does not parse, is not UTF-8 or names an unknown op still gets its reply (each line is decoded on its
own, so one bad byte costs only its line); a reply too long for one datagram has its message cut to fit; a bad
datagram never stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import TYPE_CHECKING

from deepx_sdk.errors import DeepxError
from deepx_sdk.ir.instr import request_id
from deepx_sdk.ir.text import parse_line
from deepxd.actors.opcpu import RunResult
from deepxd.net.reply import format_reply

if TYPE_CHECKING:
    from deepxd.node import Node

log = logging.getLogger(__name__)

_ID = re.compile(r"(?:^|\s)id=(\S*)")


def _request_id(line: str) -> int:
    """The `id=` of a line that did not parse, read as Instr.id reads a parsed one's: a key of its own after the
    first `//` (one search, in time linear in the line)."""
    at = line.find("//")
    m = _ID.search(line[at + 2:]) if at >= 0 else None
    return request_id(m.group(1) if m else None)


def _ms(t: float) -> int:
    return int(t * 1000)


class UdpServer(asyncio.DatagramProtocol):
    def __init__(self, node: Node) -> None:
        self.node = node
        self.queue: asyncio.Queue[tuple[bytes, tuple[str, int], float] | None] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None
        self.worker: asyncio.Task[None] | None = None
        self.lines = 0
        self.accepting = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.worker = asyncio.get_running_loop().create_task(self._work(), name="udp:deepxir")

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.accepting:
            self.queue.put_nowait((data, addr, time.time()))

    def error_received(self, exc: Exception) -> None:
        if isinstance(exc, ConnectionRefusedError):  # a sender that left before its reply (ICMP port unreachable)
            log.debug("udp: %s", exc)
        else:
            log.warning("udp: a reply was not sent: %s", exc)

    async def _work(self) -> None:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            data, addr, recv = item
            try:
                await self._datagram(data, addr, recv)
            except Exception:
                log.exception("udp: datagram from %s failed", addr)

    async def _datagram(self, data: bytes, addr: tuple[str, int], recv: float) -> None:
        offset = 0  # of the line in the datagram, in bytes
        for lineno, raw in enumerate(data.split(b"\n"), 1):
            start, offset = offset, offset + len(raw) + 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:  # this line's reply; the others run
                self.lines += 1
                rid = _request_id(raw.decode("utf-8", "replace"))
                self._send(format_reply(rid, False, _ms(recv), 0, _ms(time.time()),
                                        f"line {lineno} is not UTF-8 text: byte {e.start} of the line (byte "
                                        f"{start + e.start} of the datagram) is {raw[e.start]:#04x}"), addr)
                continue
            if not line.strip():
                continue
            self.lines += 1
            try:
                instr = parse_line(line.rstrip("\r"), lineno)
            except DeepxError as e:
                self._send(format_reply(_request_id(line), False, _ms(recv), 0, _ms(time.time()), str(e)), addr)
                continue
            rid = instr.id
            try:
                result: RunResult = await self.node.ref("scheduler").ask("run", program=[instr], fetch=[])
            except DeepxError as e:
                self._send(format_reply(rid, False, _ms(recv), 0, _ms(time.time()), str(e)), addr)
                continue
            if result.times_us:
                start = _ms(result.t0 + result.times_us[0] / 1e6)
                finish = _ms(result.t0 + result.times_us[-1] / 1e6)
            elif result.failed_at >= 0:  # it started, and failed while running (a division by zero)
                start, finish = _ms(result.t0 + result.failed_at / 1e6), _ms(time.time())
            else:
                start, finish = 0, _ms(time.time())
            error = result.error.removeprefix("instruction 1: ")
            self._send(format_reply(rid, not result.error, _ms(recv), start, finish, error), addr)

    def _send(self, reply: str, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(reply.encode("utf-8", "replace"), addr)  # fits: format_reply cut it

    async def stop_accepting(self) -> None:
        self.accepting = False

    async def close(self) -> None:
        self.queue.put_nowait(None)
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
        raise DeepxError(f"cannot listen on udp://{host}:{port}: {e.strerror or e}") from None
    sock = protocol.transport.get_extra_info("socket") if protocol.transport else None
    if sock is not None:
        import socket

        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return protocol
