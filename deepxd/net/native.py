"""The native transport: a Unix stream socket (mode 0600), or a TCP listener (a token proved by HMAC challenge,
TLS optional: deepx_core/auth.py), carrying length-prefixed msgpack frames (net/frames.py).

Requests on one connection are answered one at a time, in order, exactly one reply each. A frame over the size
limit is answered with an error and the connection closed (its bytes cannot be trusted); a frame that ends early
(the peer half-closed) is answered with an error; a body that is not msgpack is answered with an error and the
connection keeps serving.

Each connection's requests are read and answered by a task of its own (`_serve`, on asyncio's streams). A `run`
that arrives whole, in one read, while that task waits for the next frame with nothing unread, is answered in the
transport's callback instead (`_Connection.data_received`), where the scheduler can run it at once as it ran it
before (`Scheduler.now_run`: a program sent again, the actors idle): no task wakes, no actor is asked, no frame is
copied into the stream's buffer. Anything else goes to the task as before (docs/decisions/0033-round-trips-and-gelu.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import select
import socket
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CoroutineType
from typing import TYPE_CHECKING, Any

import numpy as np

from deepx_core.auth import AUTH, NONCE_BYTES, answer_matches, client_answer, new_nonce, server_answer
from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import from_numpy
from deepx_core.ir.instr import Instr
from deepx_core.ir.text import is_name
from deepx_core.ir.wire import instr_from_obj, instr_to_obj, unpack_instr, unpack_instr_cached
from deepx_core.paths import check_socket_dir, tcp_address
from deepxd import groups
from deepxd.actors.messages import ADMIN as ADMIN_QUERIES
from deepxd.actors.messages import Backward, DeleteTensor, Explain, Fetch, ListTensors, Put, Relabel, Run
from deepxd.actors.worker import LONG_PROGRAM, REMEMBER_MAX, RunResult
from deepxd.graphstore import explain_graph, graph_drop, graph_get, graph_remove, graph_store, replay_graph
from deepxd.net.frames import HEADER, PROTOCOL_VERSION, pack_frame, unpack_body
from deepxd.net.peerlink import SLICE_BYTES, split_frame
from deepxd.node import PLACED
from deepxd.owners import Owners, session_of_hello

if TYPE_CHECKING:
    from deepxd.node import Node

log = logging.getLogger(__name__)

ADMIN = tuple(ADMIN_QUERIES)  # the registry's queries a client may ask by name
LONG_FRAME = 1 << 20  # a frame at least this long is unpacked on a thread
STREAM_LIMIT = 1 << 20  # a connection's stream buffers this much before it stops reading from the socket
#: a token listener's first frame is the answer to its challenge: this small, this soon (also TLS's handshake)
AUTH_FRAME_MAX = 4096
AUTH_TIMEOUT_S = 10.0
#: refused TCP connections are logged at most this often (a scan or a flood must not fill the log)
REFUSED_LOG_S = 10.0


_paused = [0, True]  # long programs being handled, and whether the cyclic collector ran before the first


@contextlib.contextmanager
def _collector_paused(pause: bool = True) -> Iterator[None]:
    """The cyclic garbage collector off while a long program is handled: each of its full collections walked the
    program's millions of objects holding the GIL, which froze the loop a second at a time. pause=False: nothing."""
    if not pause:
        yield
        return
    if not _paused[0]:
        _paused[1] = gc.isenabled()
        gc.disable()
    _paused[0] += 1
    try:
        yield
    finally:
        _paused[0] -= 1
        if not _paused[0] and _paused[1]:
            gc.enable()


def _long_program(objs: list[Any]) -> list[Instr]:
    return [unpack_instr(o) if type(o) is bytes else instr_from_obj(o) for o in objs]


def _peer_gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Callable[[], bool]:
    """Whether the connection's peer has gone (killed, closed): the socket hung up, which the kernel says however
    many of the peer's bytes are still unread (a client that sent one more request and died); a peer that only shut
    its writing side, waiting for the reply, has not gone."""

    def gone() -> bool:
        if reader.exception() is not None:
            return True
        sock = writer.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        if fd < 0:
            return reader.at_eof()  # the transport closed it: gone once its end was read
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        return any(ev & (select.POLLHUP | select.POLLERR) for _, ev in poll.poll(0))

    return gone


def _keep_alive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive probes after a minute of silence: a client whose host vanished (no FIN ever comes) is seen gone
    within about two minutes, and its session's tensors released (release_on_close), instead of never."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer or "?")


def encode_tensor(a: np.ndarray) -> dict[str, Any]:
    """A tensor as msgpack fields; the bytes go out as a view of the array (bin), not a copy."""
    flat = np.ascontiguousarray(a).reshape(-1)
    return {"dtype": from_numpy(a.dtype), "shape": list(a.shape), "data": flat.view(np.uint8).data}


_NO_ID = object()


def encode_result(r: RunResult) -> dict[str, Any]:
    return run_reply(r)


def run_reply(r: RunResult, rid: Any = _NO_ID) -> dict[str, Any]:
    """A run's reply: `id` (where given), `ok` and the result's fields, in one map."""
    out = {"id": rid, "ok": not r.error, "done": r.done, "error": r.error or None, "error_index": r.error_index,
           "t0": r.t0, "times": array("d", r.times_us).tobytes(), "output": r.output,
           "tensors": {k: encode_tensor(v) for k, v in r.tensors.items()} if r.tensors else {}}
    if rid is _NO_ID:
        del out["id"]
    if r.placement is not None:  # run across nodes: where each instruction ran, what moved
        out["placement"] = r.placement
    return out


def check_socket_free(path: str) -> None:
    """Refuse a socket path another live process listens on; remove a stale one."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (TimeoutError, ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: nobody listens
        return
    except OSError as e:
        raise DeepxError(f"socket {path} exists and cannot be probed: {e}") from None
    finally:
        probe.close()
    raise DeepxError(f"socket {path} is in use by another deepxd; stop it or choose --listen unix:///other/path")


#: requests that make or read a session's tensors: after one, `place` "auto" keeps the session where it is
_USES = frozenset({"run", "put", "fetch", "backward", "replay"})


def _bind(bound: dict[str, Any], op: str, req: dict[str, Any], owners: Owners) -> None:
    """A connection's session state: who it is (`hello`: deepxd/owners.py), `release_on_close` {prefix} (a session's
    tensor-name prefix; "" unbinds), the prefixes its tensors are named under (`label`) and the names of the graphs
    stored over it."""
    if op == "hello":
        bound["session"] = session_of_hello(req)
    elif op == "label":
        owners.label_request(req, bound.get("session"), bound.setdefault("prefixes", set()))
    elif op == "release_on_close":
        prefix = req.get("prefix")
        if not isinstance(prefix, str) or (prefix and len(prefix) < 4):
            raise DeepxError("release_on_close: 'prefix' must be a session's name prefix (a string), or '' for none")
        bound["prefix"] = prefix
    elif isinstance(req.get("name"), str):
        bound.setdefault("graphs", set()).add(req["name"])
        if bound.get("session") is not None:  # its temporaries are named under the graph's name
            owners.bind(f"{req['name']}.", bound["session"])
            bound.setdefault("prefixes", set()).add(f"{req['name']}.")


class _Connection(asyncio.StreamReaderProtocol):
    """A native connection's protocol: asyncio's stream protocol (the connection's task, `_serve`, reads its
    frames), which answers a `run` that it can answer at once itself, as its frame arrives (NativeServer._now).

    The task says when it waits for a frame's header (`idle`); what went to its stream and what it read of it
    (`fed`, `taken`) say whether anything is left unread there. A run is answered here only then, arriving whole in
    one read: its reply goes before that of any later request, as the task's would. `pending`: the rest of an
    answer begun here that needs an await (the task awaits it before it handles the next request)."""

    def __init__(self, server: NativeServer, limit: int) -> None:
        loop = asyncio.get_running_loop()
        super().__init__(asyncio.StreamReader(limit=limit, loop=loop), self._connected, loop=loop)
        self.server = server
        self.bound: dict[str, Any] = {}  # what a session bound to this connection (release_on_close, hello, ...)
        self.ready = False  # greeted (a token listener's challenge answered): requests may be answered
        self.idle = False
        self.fed = 0
        self.taken = 0
        self.blocked = False  # replies wait in the transport (the peer does not read them)
        self.pending: asyncio.Task[None] | None = None
        self.out: asyncio.BaseTransport | None = None

    def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        return self.server._serve(reader, writer, self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.out = transport
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if (self.idle and self.fed == self.taken and self.pending is None and not self.blocked
                and self.server._now(self, data)):
            return
        self.fed += len(data)
        super().data_received(data)

    def pause_writing(self) -> None:
        self.blocked = True
        super().pause_writing()

    def resume_writing(self) -> None:
        self.blocked = False
        super().resume_writing()


def _program(prog: list[Any]) -> list[Instr]:
    """A run's instructions as sent (each msgpack-packed, or as lists); a training step's repeated ones come from the
    wire's cache."""
    return [unpack_instr_cached(o) if type(o) is bytes else instr_from_obj(o) for o in prog]


def _run_fields(req: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]] | None]:
    """A run request's `fetch` and `backwards` (each with its forward decoded), checked."""
    fetch = _tensor_names(req.get("fetch"), "run")
    backwards = req.get("backwards")
    if backwards is not None:
        if not isinstance(backwards, list) or not all(isinstance(b, dict) for b in backwards):
            raise DeepxError("run: 'backwards' must be a list of backward requests")
        for i, b in enumerate(backwards):
            _names(b.get("names"), f"run: backwards[{i}]")
        backwards = [{**b, "forward": _instrs(b.get("forward"), "backwards")} for b in backwards]
    return fetch, backwards


def _instrs(objs: Any, what: str) -> list[Instr]:
    if not isinstance(objs, list):
        raise DeepxError(f"{what}: 'forward' must be a list of instructions")
    return [unpack_instr_cached(o) if type(o) is bytes else instr_from_obj(o) for o in objs]


def _names(names: Any, what: str = "backward") -> dict[str, str] | None:
    """A backward request's `names` ({wrt: gradient name}), checked: gradients take names deepxIR text can write."""
    if names is None:
        return None
    if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        raise DeepxError(f"{what}: 'names' must map tensor names to tensor names, got {_shown(names)}")
    for v in names.values():
        if not is_name(v):
            raise DeepxError(f"{what}: 'names' gives the gradient name {v!r}, which deepxIR text cannot write "
                             "(whitespace, ',', '->', brackets or parentheses); choose another")
    return dict(names)


def _shown(value: Any) -> str:
    """A request field's value in an error message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tensor_names(value: Any, what: str) -> list[str]:
    """A request's list of tensor names (`fetch`), checked; None and absent are the empty list."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise DeepxError(f"{what}: 'fetch' must be a list of tensor names, got {_shown(value)}")
    return value

def tls_context(cert: str, key: str) -> Any:
    """A server-side TLS context (TLS 1.2 at least) from a PEM certificate (chain) and its key."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise DeepxError(f"tls_cert {cert} / tls_key {key}: cannot load them as a PEM certificate and its key: "
                         f"{getattr(e, 'strerror', None) or e}") from None
    return context


class NativeServer:
    """One native listener: `unix:///path` (file permissions and the client's SO_PEERCRED check protect it) or
    `tcp://HOST:PORT` (with `token`, every connection proves it holds it before its first request; with `tls`, a
    (certificate, key) pair of PEM files, the connection is TLS)."""

    def __init__(self, node: Node, address: str, *, max_frame: int, token: str = "",
                 tls: tuple[str, str] | None = None) -> None:
        self.node = node
        self.address = address  # a TCP listener's port 0 is replaced by the one taken, once listening
        self.path = address.removeprefix("unix://") if address.startswith("unix://") else ""
        self.token = token
        self.tls = tls
        self.max_frame = max_frame
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[asyncio.StreamWriter] = set()
        self.requests = 0
        self.refused = 0  # TCP connections refused (no token, a wrong one)
        self._refused_logged = (0.0, 0)  # when the last refusal was logged, and the count then
        self._ops = {name[4:]: getattr(self, name) for name in dir(self) if name.startswith("_op_")}

    async def start(self) -> None:
        if not self.path:
            await self._start_tcp()
            return
        d = Path(self.path).parent
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_socket_dir(d)  # a directory another user can write lets them take the socket over
        check_socket_free(self.path)
        old = os.umask(0o177)
        try:
            self.server = await asyncio.get_running_loop().create_unix_server(
                lambda: _Connection(self, STREAM_LIMIT), path=self.path)
        except OSError as e:
            raise DeepxError(f"cannot listen on unix://{self.path}: {e.strerror or e}") from None
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)

    async def _start_tcp(self) -> None:
        host, port = tcp_address(self.address, "listen")
        context = tls_context(*self.tls) if self.tls else None
        tls_args: dict[str, Any] = {"ssl": context, "ssl_handshake_timeout": AUTH_TIMEOUT_S} if context else {}
        try:
            self.server = await asyncio.get_running_loop().create_server(
                lambda: _Connection(self, STREAM_LIMIT), host, port, **tls_args)
        except OSError as e:
            hint = (": the port is in use (another deepxd, or another program); choose another port, or 0 for a "
                    "free one" if e.errno == errno.EADDRINUSE else "")
            raise DeepxError(f"cannot listen on {self.address}: {e.strerror or e}{hint}") from None
        if port == 0:  # the port taken is what the log and `deepxctl nodes ls` show
            taken = self.server.sockets[0].getsockname()[1]
            self.address = f"tcp://{f'[{host}]' if ':' in host else host}:{taken}"

    async def stop_accepting(self) -> None:
        if self.server is not None:
            self.server.close()

    async def close(self) -> None:
        for w in list(self.connections):
            w.close()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def force_close(self) -> None:
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Connection) -> None:
        self.connections.add(writer)
        bound = conn.bound  # what a session bound to this connection (release_on_close), released at its end
        gone = _peer_gone(reader, writer)  # asked by a run between its slices
        try:
            if not self.path:
                _keep_alive(writer)
                if not await self._greet(reader, writer):
                    return
            conn.ready = True
            while True:
                conn.idle = True  # (a run arriving now may be answered as it arrives)
                try:
                    header = await reader.readexactly(HEADER.size)
                except asyncio.IncompleteReadError as e:
                    if e.partial:
                        await self._reply(writer, {"id": None, "ok": False,
                                                   "error": f"truncated frame: {len(e.partial)} of 4 header bytes"})
                    return
                finally:
                    conn.idle = False
                conn.taken += HEADER.size
                (n,) = HEADER.unpack(header)
                if n > self.max_frame:
                    await self._reply(writer, {"id": None, "ok": False, "error":
                                               f"frame of {n} bytes exceeds the limit of {self.max_frame} bytes "
                                               "(max_frame_bytes); closing this connection"})
                    return
                try:
                    body = await reader.readexactly(n)
                except asyncio.IncompleteReadError as e:
                    await self._reply(writer, {"id": None, "ok": False, "error":
                                               f"truncated frame: expected {n} bytes, got {len(e.partial)}"})
                    return
                conn.taken += n
                if conn.pending is not None:  # an answer begun as its frame arrived goes out first
                    await conn.pending
                reply = await self._handle(body, bound, gone, writer)
                await self._reply(writer, reply)
                link = bound.pop("executor", None)
                if link is not None:  # an executor registered: from now on what it sends answers this node's calls
                    await self.node.executors.serve(link, reader)
                    return
        except (ConnectionError, BrokenPipeError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("native connection failed")
        finally:
            conn.ready = False
            self.connections.discard(writer)
            writer.close()
            if conn.pending is not None:  # (it answers nobody now, but finishes what it began)
                with contextlib.suppress(Exception):
                    await conn.pending
            released = bool(bound.get("prefix")) and not self.node.stopping.is_set()
            if released:
                placed = PLACED.set(bound.get("worker", ""))  # its tensors live on its GPU's worker
                try:
                    await self._release(bound["prefix"], sorted(bound.get("graphs", ())))
                finally:
                    PLACED.reset(placed)
            self.node.owners.ended(bound.get("prefixes", ()), released)

    async def _greet(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """A TCP connection's first exchange (deepx_core/auth.py), before any request is read: without a token, a
        greeting; with one, a challenge made for this connection alone, answered once (a wrong or missing answer
        closes the connection, so an answer seen on another connection never matches), then this daemon's answer
        to the client's own challenge. Whether the connection may go on."""
        if not self.token:
            await self._reply(writer, {"id": 0, "ok": True, "op": "challenge", "auth": "none"})
            return True
        nonce = new_nonce()
        await self._reply(writer, {"id": 0, "ok": True, "op": "challenge", "auth": AUTH, "nonce": nonce})
        try:
            req = await asyncio.wait_for(self._first_frame(reader), AUTH_TIMEOUT_S)
        except TimeoutError:
            return await self._refuse(writer, f"no answer to the token challenge within {AUTH_TIMEOUT_S:g} s")
        except asyncio.IncompleteReadError:
            return await self._refuse(writer, "the connection ended before it answered the token challenge")
        except DeepxError as e:
            return await self._refuse(writer, str(e))
        op = req.get("op")
        if op != "auth":
            return await self._refuse(writer, f"this listener needs a token: a connection's first request answers "
                                              f"its challenge (op 'auth'), not {_shown(op)}; connect with "
                                              "NativeClient(address, token=...) or DEEPX_TOKEN", req.get("id"))
        if not answer_matches(client_answer(self.token, nonce), req.get("answer")):
            return await self._refuse(writer, "wrong token: the answer to the challenge does not match this "
                                              "daemon's token (or answers another connection's challenge)")
        theirs = req.get("nonce")
        if not isinstance(theirs, bytes) or len(theirs) != NONCE_BYTES:
            return await self._refuse(writer, f"the answer carries no challenge of its own ({NONCE_BYTES} random "
                                              "bytes in 'nonce') for this daemon to answer")
        await self._reply(writer, {"id": 0, "ok": True, "answer": server_answer(self.token, theirs, nonce)})
        return True

    async def _first_frame(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        """An unauthenticated peer's one frame, small: it may not make the daemon read a large one."""
        (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if n > AUTH_FRAME_MAX:
            raise DeepxError(f"this listener needs a token: the first frame answers its challenge (at most "
                             f"{AUTH_FRAME_MAX} bytes), not a frame of {n} bytes; connect with NativeClient(address, "
                             "token=...) or DEEPX_TOKEN")
        return unpack_body(await reader.readexactly(n))

    async def _refuse(self, writer: asyncio.StreamWriter, reason: str, rid: Any = 0) -> bool:
        """Answer a TCP connection that did not prove the token with one line, and say so in the log (at most
        every REFUSED_LOG_S, with the count since). False: the caller closes the connection."""
        self.refused += 1
        now = time.monotonic()
        last, count = self._refused_logged
        if now - last >= REFUSED_LOG_S:
            more = self.refused - count - 1
            log.warning("native: refused a connection from %s on %s: %s%s", _peer(writer), self.address, reason,
                        f" ({more} more refused since the last such line)" if more > 0 else "")
            self._refused_logged = (now, self.refused)
        await self._reply(writer, {"id": rid, "ok": False, "error": reason})
        return False

    async def _release(self, prefix: str, graphs: list[str]) -> None:
        """A session's connection ended without the session letting go of what it made (its process was killed, or
        ended by a signal that skips interpreter exit): its tensors (names under `prefix`) are deleted and its
        compiled graphs' plans dropped, as the session's own close does (Session._release_all)."""
        from deepx_core.ir.instr import Instr, Param

        for name in graphs:
            with contextlib.suppress(DeepxError):
                await graph_drop(self.node, name)
        try:
            rows = await self.node.ref("registry").ask(ListTensors(prefix=prefix))
            mine = [Instr("deltensor", (), (Param.tensor(str(r["name"]), str(r["dtype"])),)) for r in rows
                    if str(r.get("name", "")).startswith(prefix) and r.get("node") == self.node.config.node_id]
            if mine:
                result: RunResult = await self.node.ref("scheduler").ask(Run(program=mine, fetch=[]))
                log.info("native: a session's connection ended without its close: deleted %d of its tensors (%s*)%s",
                         result.done, prefix, f"; {result.error}" if result.error else "")
        except Exception as e:  # in a connection's end: logged, never raised
            log.warning("native: could not delete the tensors of a session whose connection ended (%s*): %s", prefix, e)

    async def _reply(self, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
        try:
            split = split_frame(reply)  # a chunk for a peer: its bytes written as they are, slice by slice
            if split is None:
                writer.write(pack_frame(reply))
                await writer.drain()
                return
            head, data = split
            writer.write(head)
            for i in range(0, len(data), SLICE_BYTES):
                writer.write(data[i:i + SLICE_BYTES])
                await writer.drain()
        except (ConnectionError, BrokenPipeError):
            pass

    def _now(self, conn: _Connection, data: bytes) -> bool:
        """Answer `data` here, in the transport's callback, where it is one whole `run` frame that the scheduler runs
        at once (Scheduler.now_run); False, with nothing done, where the connection's task must handle it (any other
        request, a program the scheduler must plan or check, one of more than LONG_PROGRAM instructions, and any
        malformed request, which the task answers with its error)."""
        if not conn.ready or len(data) <= HEADER.size:
            return False
        (n,) = HEADER.unpack_from(data)
        if n != len(data) - HEADER.size or n >= LONG_FRAME:
            return False
        try:
            req = unpack_body(memoryview(data)[HEADER.size:])
            prog = req.get("program")
            if req.get("op") != "run" or type(prog) is not list or len(prog) > LONG_PROGRAM:
                return False
            program = _program(prog)
            fetch, backwards = _run_fields(req)
        except Exception:  # the task says what is wrong
            return False
        bound = conn.bound  # (what it writes is taken back from UDP's scope by the scheduler: Scheduler._now_run)
        session = bound.get("session")
        if session is not None and not self.node.owners.made_now("run", req, session, bool(bound.get("prefixes")),
                                                                 program):
            return False
        rid = req.get("id")
        bound["used"] = True
        worker = bound.get("worker", "")
        if worker == PLACED.get():  # (the first GPU's, or a session's own: nothing to set)
            return self._now_run(conn, rid, program, fetch, backwards)
        placed = PLACED.set(worker)  # (the task made for the rest copies it)
        try:
            return self._now_run(conn, rid, program, fetch, backwards)
        finally:
            PLACED.reset(placed)

    def _now_run(self, conn: _Connection, rid: Any, program: Any, fetch: Any, backwards: Any) -> bool:
        node = self.node
        try:
            done = node.ref("scheduler").now(Run(program, fetch, backwards))
        except Exception as e:  # it may have begun: answered with the error, never run again by the task
            self.requests += 1
            if not isinstance(e, DeepxError):
                log.exception("request failed")
            self._write(conn, rid, None, {"id": rid, "ok": False, "error": str(e) if isinstance(e, DeepxError) else
                                          f"internal error: {type(e).__name__}: {e}"})
            return True
        if done is None:
            return False
        self.requests += 1
        if type(done) is CoroutineType:
            conn.pending = asyncio.get_running_loop().create_task(self._finish(conn, rid, done))
        else:
            self._write(conn, rid, done)
        return True

    async def _finish(self, conn: _Connection, rid: Any, rest: Any) -> None:
        """The reply to a run begun as its frame arrived, whose answer needed an await."""
        try:
            result = await rest
        except DeepxError as e:
            self._write(conn, rid, None, {"id": rid, "ok": False, "error": str(e)})
        except Exception as e:
            log.exception("request failed")
            self._write(conn, rid, None, {"id": rid, "ok": False, "error": f"internal error: {type(e).__name__}: {e}"})
        else:
            self._write(conn, rid, result)
        finally:
            conn.pending = None

    @staticmethod
    def _write(conn: _Connection, rid: Any, result: RunResult | None, reply: dict[str, Any] | None = None) -> None:
        """The reply to a run answered in the transport's callback (`result`'s, else `reply`), packed once."""
        out_transport = conn.out
        if out_transport is not None and not out_transport.is_closing():
            if reply is None:
                assert result is not None
                reply = run_reply(result, rid)
            out_transport.write(pack_frame(reply))  # type: ignore[attr-defined]

    async def _handle(self, body: bytes, bound: dict[str, Any] | None = None,
                      gone: Callable[[], bool] | None = None,
                      writer: asyncio.StreamWriter | None = None) -> dict[str, Any]:
        """The reply to one request. `gone`: whether the connection's peer has gone (a run then stops); `writer`:
        the connection's (an executor registers on it)."""
        self.requests += 1
        rid = None
        placed = PLACED.set(bound.get("worker", "") if bound else "")  # the session's GPU (`place`)
        try:
            # a long program's frame is unpacked off the loop: other connections are served meanwhile
            if len(body) < LONG_FRAME:
                req = unpack_body(body)
            else:
                with _collector_paused():
                    req = await asyncio.to_thread(unpack_body, body)
            rid = req.get("id")
            op = req.get("op")
            if bound is not None and op in ("release_on_close", "graph_store", "hello", "label"):
                _bind(bound, op, req, self.node.owners)
            elif bound is not None and op in ("put", "run") and bound.get("session") is not None:
                await self.node.owners.made_by(op, req, bound["session"], bool(bound.get("prefixes")))
            handler = self._ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise DeepxError(f"unknown request op {op!r}; known: {', '.join(sorted(self._ops))}")
            if bound is not None and op in _USES:
                bound["used"] = True
            if op in ("run", "peer_run"):
                out = await handler(req, gone)
            elif op in ("executor_register", "place"):
                out = await handler(req, bound, writer)
            else:
                out = await handler(req)
            return {"id": rid, "ok": True, **out}
        except DeepxError as e:
            return {"id": rid, "ok": False, "error": str(e)}
        except Exception as e:
            log.exception("request failed")
            return {"id": rid, "ok": False, "error": f"internal error: {type(e).__name__}: {e}"}
        finally:
            PLACED.reset(placed)

    # -- requests
    async def _op_ping(self, req: dict[str, Any]) -> dict[str, Any]:
        return {}

    async def _op_release_on_close(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"prefix": req.get("prefix")}  # recorded for the connection by _handle

    async def _op_label(self, req: dict[str, Any]) -> dict[str, Any]:
        names = list(req.get("tensors") or ())  # recorded for the connection's session by _handle
        if names and "heapmem" in self.node.refs:  # a heap tensor's record in the plane carries them too
            await self.node.ref("heapmem").ask(Relabel(names=names))
        return {"labelled": len(names)}

    async def _op_hello(self, req: dict[str, Any]) -> dict[str, Any]:
        v = req.get("version")
        if v != PROTOCOL_VERSION:
            raise DeepxError(f"protocol version {v!r} is not supported; this deepxd speaks version {PROTOCOL_VERSION}")
        c = self.node.config
        return {"version": PROTOCOL_VERSION, "node": c.node_id, "roles": c.roles, "max_frame": self.max_frame,
                "pid": os.getpid()}

    async def _op_run(self, req: dict[str, Any], gone: Callable[[], bool] | None = None) -> dict[str, Any]:
        prog = req.get("program")
        if not isinstance(prog, list):
            raise DeepxError("run: 'program' must be a list of instructions")
        with _collector_paused(len(prog) > LONG_PROGRAM):
            if len(prog) > REMEMBER_MAX:  # O(n): off the loop, and not through the cache of repeated instructions
                program = await asyncio.to_thread(_long_program, prog)
            else:  # (a training step's, again and again: its instructions cached)
                program = _program(prog)
            fetch, backwards = _run_fields(req)
            result: RunResult = await self.node.ref("scheduler").ask(Run(program=program, fetch=fetch,
                                                                     backwards=backwards, cancel=gone))
            out = (encode_result(result) if result.done <= REMEMBER_MAX
                   else await asyncio.to_thread(encode_result, result))
            ok = out.pop("ok")
            if not ok:
                return {**out, "ok": False}
            return out

    async def _op_backward(self, req: dict[str, Any]) -> dict[str, Any]:
        forward = _instrs(req.get("forward"), "backward")
        loss, wrt = req.get("loss"), req.get("wrt")
        if not isinstance(loss, str) or not isinstance(wrt, list) or not all(isinstance(w, str) for w in wrt):
            raise DeepxError("backward: 'loss' must be a tensor name and 'wrt' a list of tensor names")
        grad_loss = req.get("grad_loss")
        out = await self.node.ref("scheduler").ask(Backward(forward=forward, loss=loss, wrt=wrt,
                                                   grad_loss=grad_loss if isinstance(grad_loss, str) else None,
                                                   prefix=str(req.get("prefix") or "g_"),
                                                   capture=bool(req.get("capture", False)),
                                                   names=_names(req.get("names"))))
        if "program" in out:
            out["program"] = [instr_to_obj(i) for i in out["program"]]
        return dict(out)

    # -- stored graphs (dx.compile; docs/graphs.md)
    async def _op_graph_store(self, req: dict[str, Any]) -> dict[str, Any]:
        return await graph_store(self.node, name=req.get("name"), data=req.get("data"))

    async def _op_graph_drop(self, req: dict[str, Any]) -> dict[str, Any]:
        return await graph_drop(self.node, name=req.get("name"))

    async def _op_graph_rm(self, req: dict[str, Any]) -> dict[str, Any]:
        return await graph_remove(self.node, name=req.get("name"))

    async def _op_graph_get(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"data": await graph_get(self.node, name=req.get("name"))}

    async def _op_replay(self, req: dict[str, Any]) -> dict[str, Any]:
        from deepx_core.graphrecord import check_graph_name

        name = check_graph_name(req.get("name"))
        fetch = req.get("fetch") or []
        if not isinstance(fetch, list) or not all(isinstance(x, str) for x in fetch):
            raise DeepxError(f"replay of graph {name!r}: 'fetch' must be a list of tensor names")
        result = await replay_graph(self.node, name=name, inputs=req.get("inputs") or {},
                                    outputs=req.get("outputs") or {}, scalars=req.get("scalars") or {}, fetch=fetch)
        out = encode_result(result)
        if not out.pop("ok"):
            raise DeepxError(out["error"] or "replay failed")
        return out

    async def _op_explain(self, req: dict[str, Any]) -> dict[str, Any]:
        if "graph" in req:
            return await explain_graph(self.node, graph=req.get("graph"))
        prog = req.get("program")
        if not isinstance(prog, list):
            raise DeepxError("explain: give 'graph' (a stored graph's name) or 'program' (a list of instructions)")
        program = [unpack_instr_cached(o) if type(o) is bytes else instr_from_obj(o) for o in prog]
        fetch = _tensor_names(req.get("fetch"), "explain")
        return dict(await self.node.ref("scheduler").ask(Explain(program=program, fetch=fetch)))

    async def _op_place(self, req: dict[str, Any], bound: dict[str, Any] | None = None,
                        writer: Any = None) -> dict[str, Any]:
        """Which GPU this connection's session runs on, where the daemon has several (op-cuda's workers, one per
        GPU): `device` "cuda:N", or "auto" with `local_rank` (init_process_group's choice, taken only while the
        session has run nothing: its tensors live on one worker). Answers the device it runs on."""
        if bound is None:
            raise DeepxError("place: a session's request, over its own connection")
        device = req.get("device")
        chosen = self.node.place(device, req.get("local_rank"))
        if device == "auto" and bound.get("used"):
            chosen = bound.get("worker", "")  # it made tensors on its GPU already: it stays there
        if chosen == next(iter(self.node.cuda_workers), ""):
            chosen = ""  # the first GPU's worker: the default
        bound["worker"] = chosen
        first = next(iter(self.node.gpus.values()), {"device": "cpu"})
        return {"device": self.node.gpus[chosen]["device"] if chosen else first["device"]}

    # -- process groups (deepx_sdk.distributed; deepxd/groups.py)
    async def _op_group_join(self, req: dict[str, Any]) -> dict[str, Any]:
        return await groups.join(self.node, req.get("group"), req.get("world_size"), req.get("rank"), req.get("pid"),
                                 req.get("host"), req.get("timeout"), req.get("backend"))

    async def _op_group_barrier(self, req: dict[str, Any]) -> dict[str, Any]:
        programs = {}
        for field in ("before", "then"):
            prog = req.get(field) or []
            if not isinstance(prog, list):
                raise DeepxError(f"group_barrier: '{field}' must be a list of instructions")
            programs[field] = [unpack_instr_cached(o) if type(o) is bytes else instr_from_obj(o) for o in prog]
        return await groups.barrier(self.node, req.get("group"), req.get("gen"), req.get("rank"), req.get("seq"),
                                    req.get("timeout"), req.get("what", "barrier"), programs["then"],
                                    req.get("leaving", False), programs["before"])

    async def _op_group_leave(self, req: dict[str, Any]) -> dict[str, Any]:
        return await groups.leave(self.node, req.get("group"), req.get("gen"), req.get("rank"),
                                  req.get("delete") or [], req.get("forget") or [])

    # -- executors of other processes (deepxd/executors.py, docs/executor.md)
    async def _op_executor_register(self, req: dict[str, Any], bound: dict[str, Any] | None = None,
                                    writer: asyncio.StreamWriter | None = None) -> dict[str, Any]:
        """This connection's process becomes an executor of the node: the node sends it instructions from now on,
        and what it sends answers them."""
        if bound is None or writer is None:
            raise DeepxError("executor_register: only a connection can register as an executor")
        if "scheduler" not in self.node.refs:
            raise DeepxError(f"executor_register: node {self.node.config.node_id} runs no scheduler (roles: "
                             f"{','.join(self.node.config.roles)}), which is what places instructions on executors")
        session = bound.get("session")
        client = {"pid": session.pid, "host": session.host} if session is not None else None
        peer = self.address if self.path else f"{self.address} from {_peer(writer)}"
        link = self.node.executors.register(req, writer, peer, client)
        bound["executor"] = link
        return {"node": self.node.config.node_id, "executor": link.name, "ops": sorted(link.offers),
                "attach": link.attach}

    # -- peer links: another deepxd's requests (deepxd/peers.py)
    async def _op_peer_ping(self, req: dict[str, Any]) -> dict[str, Any]:
        return await self._peers().serve_ping(req)

    async def _op_peer_hold(self, req: dict[str, Any]) -> dict[str, Any]:
        return await self._peers().serve_hold(req)

    async def _op_peer_read(self, req: dict[str, Any]) -> dict[str, Any]:
        return await self._peers().serve_read(req)

    async def _op_peer_run(self, req: dict[str, Any], gone: Callable[[], bool] | None = None) -> dict[str, Any]:
        """A segment of another node's program, placed here (deepxd/placement.py); `gone`: whether that node hung
        up (it stopped waiting: the segment stops as a run whose client went does)."""
        from deepxd.placement import serve_peer_run

        prog = req.get("program") or []
        if not isinstance(prog, list):
            raise DeepxError("peer_run: 'program' must be a list of instructions")
        node = req.get("node")
        if isinstance(node, str) and self.node.peers is not None:
            self.node.peers.heard_from(node)
        return await serve_peer_run(self.node.ref("scheduler"), self.node.worker(), req, _program(prog), gone)

    async def _op_coll_read(self, req: dict[str, Any]) -> dict[str, Any]:
        """A unit of a collective, for the next rank of a process group (deepxd/comm.py)."""
        if self.node.comm is None:
            raise DeepxError("this deepxd is not started: it runs no collectives")
        return await self.node.comm.serve_read(req)

    def _peers(self) -> Any:
        if self.node.peers is None:
            raise DeepxError("this deepxd is not started: it has no peer links")
        return self.node.peers

    async def _op_fetch(self, req: dict[str, Any]) -> dict[str, Any]:
        names = req.get("names")
        if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
            raise DeepxError("fetch: 'names' must be a list of tensor names")
        arrays = await self.node.worker().ask(Fetch(names=names))
        return {"tensors": {k: encode_tensor(v) for k, v in arrays.items()}}

    async def _op_put(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            name, dtype, shape, data = req["name"], req["dtype"], req["shape"], req["data"]
        except KeyError as e:
            raise DeepxError(f"put: missing field {e.args[0]!r} (need name, dtype, shape, data)") from None
        # each field's type exactly: what a client sends wrong is refused, never coerced (bool("no") is True)
        if not isinstance(name, str) or not is_name(name):
            raise DeepxError(f"put: 'name' must be a tensor name deepxIR text can write (not empty; no whitespace, "
                             f"',', '->', brackets or parentheses), got {_shown(name)}")
        if not isinstance(dtype, str):
            raise DeepxError(f"put of '{name}': 'dtype' must be a dtype's name (float32, int64, ...), got "
                             f"{_shown(dtype)}")
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            raise DeepxError(f"put of '{name}': 'shape' must be a list of whole numbers, got {_shown(shape)}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DeepxError(f"put of '{name}': 'data' must be the tensor's bytes (bin), got {type(data).__name__}")
        heap, owner = req.get("heap"), req.get("owner")  # nil as absent: false, no owner
        heap = False if heap is None else heap
        owner = "" if owner is None else owner
        if not isinstance(heap, bool):
            raise DeepxError(f"put of '{name}': 'heap' must be true or false, got {_shown(heap)}")
        if not isinstance(owner, str):
            raise DeepxError(f"put of '{name}': 'owner' must be a string (who holds the tensor), got {_shown(owner)}")
        if self.node.udp_scope is not None:  # before it is written: a UDP line must not come between
            self.node.udp_scope.taken_back([name])
        info = await self.node.worker().ask(Put(name=name, dtype=dtype, shape=shape, data=data, heap=heap,
                                            owner=owner))
        return {"tensor": info}

    async def _op_udp_share(self, req: dict[str, Any]) -> dict[str, Any]:
        names, shared = req.get("names"), req.get("shared", True)
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise DeepxError(f"udp_share: 'names' must be a list of tensor names, got {_shown(names)}")
        if not isinstance(shared, bool):
            raise DeepxError(f"udp_share: 'shared' must be true or false, got {_shown(shared)}")
        scope = self.node.udp_scope
        if scope is None:
            raise DeepxError("udp_share: deepxIR over UDP is off on this daemon (--udp off)")
        if shared:
            found = set(await scope.existing(names))
            missing = [n for n in names if n not in found]
            if missing:
                raise DeepxError(f"udp_share: no tensor named {', '.join(map(repr, missing))} on this daemon "
                                 "(`deepxctl tensors ls` lists them)")
        scope.share(names, shared)
        return {"names": names, "shared": shared}

    async def _op_admin(self, req: dict[str, Any]) -> dict[str, Any]:
        what = req.get("what")
        if what == "config":
            return {"result": self.node.config.shown()}  # never a password (docs/storage.md)
        if what not in ADMIN:
            raise DeepxError(f"admin: unknown query {what!r}; known: {', '.join((*ADMIN, 'config'))}")
        if what == "tensors":
            prefix = req.get("prefix", "")
            if not isinstance(prefix, str):
                raise DeepxError(f"admin tensors: prefix must be a string, got {type(prefix).__name__}")
            return {"result": await self.node.ref("registry").ask(ListTensors(prefix=prefix))}
        return {"result": await self.node.ref("registry").ask(ADMIN_QUERIES[what]())}


    async def _op_delete(self, req: dict[str, Any]) -> dict[str, Any]:
        name = req.get("name")
        if not isinstance(name, str) or not name:
            raise DeepxError("delete: 'name' must be a tensor name")
        force = req.get("force", False)
        if not isinstance(force, bool):  # never coerced: bool("no") is True
            raise DeepxError(f"delete of '{name}': 'force' must be true or false, got {_shown(force)}")
        info = await self.node.ref("registry").ask(DeleteTensor(name=name, force=force))
        if self.node.udp_scope is not None:
            self.node.udp_scope.deleted([name])
        return {"tensor": info}
