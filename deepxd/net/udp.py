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

A line is answered as its datagram arrives, in the transport's callback, where nothing waits before it (no sender's
backlog, no turn under way) and it needs no await: it names only what UDP may reach, and the scheduler runs it at
once as it ran it before (`Scheduler.now_run`: an instruction sent again, the actors idle). Any other line, and what
follows it in its datagram, goes to the backlog and its turn (docs/decisions/0033-round-trips-and-gelu.md). The
sender's own metadata (`id`, `created_at`, `sent_at`, `author`) is read for the reply and dropped before the line
runs, so that a line sent again with a new id and time is the same instruction to the scheduler and the worker (their
caches of programs run before); the keys that change what runs (`benchmark.repeat`, `kind`, `exists`, and any other)
stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import re
import time
from collections import deque
from collections.abc import Iterator
from types import CoroutineType
from typing import TYPE_CHECKING, Any

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, request_id
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
#: metadata that speaks of the sending, not of what runs: read for the reply, dropped before the line runs
SENDER_META = frozenset(("id", "created_at", "sent_at", "author"))
SEEN_MAX = 1024  # distinct instructions remembered as one object each (forgotten all at once past this)

_new = tuple.__new__


def _request_id(line: str) -> int:
    """The `id=` of a line that did not parse, read as Instr.id reads a parsed one's: a key of its own after the
    first `//` (one search, in time linear in the line)."""
    at = line.find("//")
    m = _ID.search(line[at + 2:]) if at >= 0 else None
    return request_id(m.group(1) if m else None)


def _ms(t: float) -> int:
    return int(t * 1000)


class _Datagram:
    """One received datagram, run a turn's worth of lines at a time. `held`: its next line, parsed, where it was
    begun as the datagram arrived and must go on in a turn: (instruction, request id, and None, or the coroutine
    that finishes the scheduler's answer)."""

    __slots__ = ("addr", "held", "lines", "recv", "size")

    def __init__(self, data: bytes, addr: tuple[str, int], recv: float) -> None:
        self.addr = addr
        self.recv = recv
        self.size = len(data)
        self.lines = _split(data)
        self.held: tuple[Instr, int, Any] | None = None


def _bare(instr: Instr) -> Instr:
    """`instr` without the sender's metadata (SENDER_META)."""
    meta = instr.meta
    if not meta:
        return instr
    kept = tuple(kv for kv in meta if kv[0] not in SENDER_META)
    return instr if len(kept) == len(meta) else _new(Instr, (instr.name, instr.args, instr.returns, kept))


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
        self.turning = False  # a turn is under way (its sender's datagrams are out of the backlog meanwhile)
        self._seen: dict[Instr, Instr] = {}  # the instructions of recent lines (_parsed), each one object
        self.lines = 0
        self.answered_now = 0  # lines answered in the transport's callback, as their datagram arrived
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
        if not self.backlog and not self.turning and self.writable.is_set():
            item = _Datagram(data, addr, time.time())
            if self._now(item):
                return
            self._queue(item, addr)
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
        self._queue(_Datagram(data, addr, time.time()), addr)

    def _queue(self, item: _Datagram, addr: tuple[str, int]) -> None:
        self.backlog.setdefault(addr, deque()).append(item)
        self.backlog_bytes[addr] = self.backlog_bytes.get(addr, 0) + item.size
        self.waiting += item.size
        self.wake.set()

    def _now(self, item: _Datagram) -> bool:
        """Answer the datagram's lines here, in the transport's callback, up to a turn's budget and while each needs
        no await; True where all were answered. Else the line that needs one is left parsed in `held`."""
        deadline = time.perf_counter() + TURN_S
        recv, addr = item.recv, item.addr
        for n, line in enumerate(item.lines, 1):
            if n > TURN_LINES or (n > 1 and time.perf_counter() > deadline):  # the rest in turns
                item.lines = itertools.chain((line,), item.lines)
                return False
            parsed = self._parsed(*line, addr, recv)
            if parsed is not None:
                instr, rid = parsed
                answer = self._run_now(instr, rid, addr, recv)
                if answer is not True:  # None: the line takes the ask; a coroutine: the rest of its answer
                    item.held = (instr, rid, answer)
                    return False
        return True

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
            self.turning = True
            try:
                finished = await self._turn(item)
            except Exception:
                log.exception("udp: datagram from %s failed", item.addr)
                finished = True
            finally:
                self.turning = False
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
        first = 1
        if item.held is not None:
            (instr, rid, rest), item.held = item.held, None
            await self._run(instr, rid, item.addr, item.recv, rest)
            first = 2
        for n, (lineno, start, raw) in enumerate(item.lines, first):
            await self._line(lineno, start, raw, item.addr, item.recv)
            if n >= TURN_LINES or time.perf_counter() > deadline:
                return False
        return True

    async def _line(self, lineno: int, start: int, raw: bytes, addr: tuple[str, int], recv: float) -> None:
        parsed = self._parsed(lineno, start, raw, addr, recv)
        if parsed is not None:
            await self._run(*parsed, addr, recv)

    def _parsed(self, lineno: int, start: int, raw: bytes, addr: tuple[str, int],
                recv: float) -> tuple[Instr, int] | None:
        """The line's instruction, without the sender's metadata, and its request id; None where there is nothing
        to run: a blank line, or one answered here (not UTF-8, not an instruction)."""
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # this line's reply; the others run
            self.lines += 1
            rid = _request_id(raw.decode("utf-8", "replace"))
            self._send(format_reply(rid, False, _ms(recv), 0, _ms(time.time()),
                                    f"line {lineno} is not UTF-8 text: byte {e.start} of the line (byte "
                                    f"{start + e.start} of the datagram) is {raw[e.start]:#04x}"), addr)
            return None
        if not line.strip():
            return None
        self.lines += 1
        try:
            instr = parse_line(line.rstrip("\r"), lineno)
        except DeepxError as e:
            self._send(format_reply(_request_id(line), False, _ms(recv), 0, _ms(time.time()), str(e)), addr)
            return None
        rid, bare = instr.id, _bare(instr)
        try:  # the instruction of the last lines that were this one (their caches compare it by identity first)
            known = self._seen.get(bare)
        except TypeError:  # a value that does not hash: nothing to share
            return bare, rid
        if known is None:
            if len(self._seen) >= SEEN_MAX:
                self._seen.clear()
            known = self._seen[bare] = bare
        return known, rid

    def _run_now(self, instr: Instr, rid: int, addr: tuple[str, int], recv: float) -> Any:
        """Answer the line without an await where it can be: it names only what UDP may reach (so the scope's check
        needs nothing looked up) and the scheduler runs it at once (now_run, which looks at both). True where it was
        answered; None where it takes the ask (nothing ran); or a coroutine that finishes the scheduler's answer (to
        await in a turn)."""
        try:
            done = self.node.ref("scheduler").now(Run([instr], (), origin="udp"))
        except Exception as e:  # it may have begun: answered with the error, never run again by the ask
            if not isinstance(e, DeepxError):
                log.exception("udp: a line from %s failed", addr)
            self._send(format_reply(rid, False, _ms(recv), 0, _ms(time.time()),
                                    str(e) if isinstance(e, DeepxError) else
                                    f"internal error: {type(e).__name__}: {e}"), addr)
            return True
        if done is None or type(done) is CoroutineType:
            return done
        self.answered_now += 1
        self._ran(instr, rid, addr, recv, done)
        return True

    async def _run(self, instr: Instr, rid: int, addr: tuple[str, int], recv: float, rest: Any = None) -> None:
        """Run the line through the scheduler's ask (`rest`: or finish the answer the scheduler began), and reply."""
        try:
            if rest is not None:
                result: RunResult = await rest
            else:  # origin udp: the scheduler checks what the line may name (deepxd/access.py) as it runs it
                result = await self.node.ref("scheduler").ask(Run(program=[instr], fetch=[], origin="udp"))
        except DeepxError as e:
            self._send(format_reply(rid, False, _ms(recv), 0, _ms(time.time()), str(e)), addr)
            return
        if rest is not None:
            self._ran(instr, rid, addr, recv, result)
        else:
            self._reply(rid, addr, recv, result)

    def _ran(self, instr: Instr, rid: int, addr: tuple[str, int], recv: float, result: RunResult) -> None:
        """A line the scheduler ran at once (no check of its scope was due: it named only UDP's): what it did to
        the set of tensors told to the scope, as on_run does for a UDP program, and the reply."""
        scope = self.node.udp_scope
        if result.done and scope is not None:
            scope.ran(instr)
        self._reply(rid, addr, recv, result)

    def _reply(self, rid: int, addr: tuple[str, int], recv: float, result: RunResult) -> None:
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
