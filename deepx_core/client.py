"""A blocking client for deepxd's native protocol (length-prefixed msgpack frames over a Unix socket or TCP).

Here in the base so that deepxctl talks to a daemon without importing the SDK; the SDK re-exports it as
`deepx_sdk.client`.

    from deepx_sdk.client import NativeClient
    with NativeClient() as c:                      # DEEPX_ADDRESS, else the default socket
        c.put("x", np.ones((2, 3), np.float32))
        reply = c.run(parse_text("mulscalar (tensor:x, var:2) -> (tensor:y)"), fetch=["y"])
        reply.tensors["y"]

    NativeClient("tcp://10.0.0.5:7070", token=...)  # a daemon started with --listen tcp://... --token-file
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from deepx_core.auth import AUTH, NONCE_BYTES, answer_matches, client_answer, new_nonce, server_answer, token_from_env
from deepx_core.errors import DeepxError
from deepx_core.identity import this_process
from deepx_core.ir.dtypes import from_numpy, to_numpy
from deepx_core.ir.instr import Instr
from deepx_core.ir.wire import pack_instr_cached
from deepx_core.paths import default_address, tcp_address

PROTOCOL_VERSION = 1
_HEADER = struct.Struct(">I")


class DeepxTimeoutError(DeepxError, TimeoutError):
    """deepxd did not answer within the client's timeout: a DeepxError (what deepx raises for a refused request) that
    is also a TimeoutError, so that a caller (deepxctl's --timeout) can tell a slow daemon from a lost connection.
    The connection is closed then: a late reply would be taken for the next request's."""


def decode_tensor(obj: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(obj["data"], dtype=to_numpy(obj["dtype"])).reshape(obj["shape"])


@dataclass
class RunReply:
    ok: bool
    done: int
    error: str | None
    error_index: int
    t0: float
    times: bytes  # float64 (start, end) per instruction that ran, microseconds after t0
    output: list[str] = field(default_factory=list)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    # a program run across nodes: each instruction's node and worker, what moved (docs/cluster.md); else None
    placement: dict[str, Any] | None = None

    @property
    def times_us(self) -> np.ndarray:
        """(start, end) of each instruction that ran, microseconds after t0."""
        return np.frombuffer(self.times, dtype=np.float64).reshape(-1, 2)

    def raise_for_error(self) -> RunReply:
        if not self.ok:
            raise DeepxError(self.error or "program failed")
        return self


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def check_peer(sock: socket.socket, address: str, expected: int | None = None, *, root_ok: bool = True) -> None:
    """Refuse a daemon that runs as another user before anything is sent to it: whoever listens on the socket path
    (one put in a directory another user could write, say) would get the hello and every tensor's bytes. Expected:
    `expected`, else DEEPX_PEER_UID, else this user, or root where `root_ok` (an address the user chose: the default
    path is this user's own daemon's, and a squatter could link it to any socket of root's)."""
    so_peercred = getattr(socket, "SO_PEERCRED", None)
    if so_peercred is None:  # not Linux: the socket's 0600 mode in its 0700 directory is the only check
        return
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, so_peercred, _PEERCRED.size))
    if expected is None and os.environ.get("DEEPX_PEER_UID", "").strip():
        try:
            expected = int(os.environ["DEEPX_PEER_UID"])
        except ValueError:
            raise DeepxError(f"DEEPX_PEER_UID={os.environ['DEEPX_PEER_UID']!r} is not a user id (a number)") from None
    allowed = (expected,) if expected is not None else (os.geteuid(), 0) if root_ok else (os.geteuid(),)
    if uid not in allowed:
        who = f"uid {expected}" if expected is not None else f"you (uid {os.geteuid()}){' or root' if root_ok else ''}"
        raise DeepxError(f"the process listening at {address} runs as uid {uid}, not as {who}: nothing was sent to it "
                         "(another user may have taken over the socket path). If that daemon is meant to be another "
                         f"user's, pass NativeClient(peer_uid={uid}) or set DEEPX_PEER_UID={uid}")


def _tls_wrap(raw: socket.socket, host: str, address: str, cafile: str | None) -> socket.socket:
    """The connection under TLS, the daemon's certificate checked against `cafile` (else the system's CAs) and
    `host`."""
    import ssl

    try:
        context = ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as e:
        raise DeepxError(f"cafile {cafile}: cannot load it as PEM certificates: {e}") from None
    try:
        return context.wrap_socket(raw, server_hostname=host)
    except ssl.SSLCertVerificationError as e:
        raise DeepxError(f"TLS with deepxd at {address}: its certificate is not trusted ({e.verify_message}): pass "
                         "cafile= its certificate or CA (deepxctl --tls-cafile, DEEPX_TLS_CAFILE)") from None
    except (ssl.SSLError, OSError) as e:
        raise DeepxError(f"TLS with deepxd at {address} failed: {e}; is its listener TLS (deepxd start "
                         "--tls-cert)? Without it, connect without tls") from None


#: how long a client waits for a TCP listener's greeting (and its answer to the client's challenge)
HANDSHAKE_S = 10.0


class NativeClient:
    """A connection to a deepxd: `unix:///path` (the local socket: its file mode and the listener's uid protect it)
    or `tcp://host:port` (a token proves who may use it: `token`, else DEEPX_TOKEN, else the file DEEPX_TOKEN_FILE
    names; `tls` or `cafile` (else DEEPX_TLS=1, DEEPX_TLS_CAFILE) for a listener started with --tls-cert)."""

    def __init__(self, address: str | None = None, *, timeout: float | None = None, client: str = "deepx_sdk",
                 hello: bool = True, peer_uid: int | None = None, token: str | None = None, tls: bool | None = None,
                 cafile: str | None = None, name: str | None = None) -> None:
        chosen = bool(address or os.environ.get("DEEPX_ADDRESS"))
        address = address or default_address()
        self.address = address
        if address.startswith("unix://"):
            if token is not None or tls or cafile:
                raise DeepxError(f"{address} is a Unix socket, which asks no token and has no TLS (its file "
                                 "permissions protect it): token=, tls= and cafile= are for tcp:// addresses")
            self.path = address.removeprefix("unix://")  # the socket file (a unix:// address only)
            self.sock = self._connect_unix(address, timeout, peer_uid, chosen)
        elif address.startswith("tcp://"):
            self.path = ""
            self.sock = self._connect_tcp(address, timeout, token, tls, cafile)
        else:
            raise DeepxError(f"cannot connect to {address!r}: deepxd's native protocol is addressed as "
                             "unix:///path/to/deepxd.sock or tcp://host:port (a deepx executor's udp://host:port is "
                             "for dx.connect)")
        self._ids = itertools.count(1)
        # one request at a time on the connection: threads that share a client (a session's) would otherwise read
        # each other's replies
        self._request_lock = threading.Lock()
        self.server: dict[str, Any] = {}
        if hello:
            # who this is (name, pid, host): the daemon shows it as the owner of what this connection makes
            self.server = self.request("hello", version=PROTOCOL_VERSION, client=client, **this_process(name))

    def _connect_unix(self, address: str, timeout: float | None, peer_uid: int | None, chosen: bool) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            raise DeepxError(f"cannot reach deepxd at {address}: {e.strerror or e}; is it running "
                             "(deepxd start)?") from None
        try:
            check_peer(sock, address, peer_uid, root_ok=chosen)
        except BaseException:
            sock.close()
            raise
        return sock

    def _connect_tcp(self, address: str, timeout: float | None, token: str | None, tls: bool | None,
                     cafile: str | None) -> socket.socket:
        host, port = tcp_address(address)
        if token is None:
            token = token_from_env()
        cafile = cafile or os.environ.get("DEEPX_TLS_CAFILE") or None
        if tls is None:
            tls = bool(cafile) or os.environ.get("DEEPX_TLS", "").strip() not in ("", "0")
        handshake = HANDSHAKE_S if timeout is None else min(timeout, HANDSHAKE_S)
        try:
            raw = socket.create_connection((host, port), timeout=handshake)
        except OSError as e:
            raise DeepxError(f"cannot reach deepxd at {address}: {e.strerror or e}; is it running with "
                             f"--listen {address}?") from None
        sock: socket.socket = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request's header and body go at once
            if tls:
                sock = _tls_wrap(raw, host, address, cafile)
            self.sock = sock
            self._greet(token, handshake)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(timeout)
        return sock

    def _greet(self, token: str | None, handshake: float) -> None:
        """TCP's first exchange (deepx_core/auth.py): answer the listener's challenge with the token, and check its
        answer to ours, before anything else is sent."""
        try:
            first = self.recv_frame()
        except DeepxTimeoutError:
            raise DeepxError(f"deepxd at {self.address} sent no greeting within {handshake:g} s: a TLS "
                             "listener (deepxd start --tls-cert) needs tls=True (deepxctl --tls), or what listens "
                             "there is not a deepxd") from None
        if first.get("op") != "challenge" or first.get("auth") not in (AUTH, "none"):
            raise DeepxError(f"{self.address} did not greet as a deepxd's TCP listener does (got "
                             f"{str(first)[:80]}): is it a deepxd of this version?")
        if first["auth"] == "none":
            if token:
                raise DeepxError(f"deepxd at {self.address} asks no token, so it cannot prove that it is the daemon "
                                 "your token is for: nothing was sent to it. Start it with --token-file, or connect "
                                 "without a token (unset DEEPX_TOKEN)")
            return
        if not token:
            raise DeepxError(f"deepxd at {self.address} asks for a token and none was given: pass token= "
                             "(NativeClient, dx.connect), or set DEEPX_TOKEN or DEEPX_TOKEN_FILE (deepxctl: "
                             "--token-file)")
        nonce = first.get("nonce")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise DeepxError(f"deepxd at {self.address} sent a malformed challenge (no {NONCE_BYTES}-byte nonce)")
        mine = new_nonce()
        self.send_frame({"id": 0, "op": "auth", "answer": client_answer(token, nonce), "nonce": mine})
        reply = self.recv_frame()
        if not reply.get("ok"):
            raise DeepxError(f"deepxd at {self.address} refused the connection: {reply.get('error')}")
        if not answer_matches(server_answer(token, mine, nonce), reply.get("answer")):
            raise DeepxError(f"deepxd at {self.address} did not prove that it holds the token (its answer to this "
                             "client's challenge is wrong): nothing was sent to it")

    def __enter__(self) -> NativeClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    # -- frames
    def send_frame(self, obj: dict[str, Any]) -> None:
        body = msgpack.packb(obj, use_bin_type=True)
        if len(body) < 65536:
            self.sock.sendall(_HEADER.pack(len(body)) + body)
        else:  # large frames (tensor data): no concatenated copy
            self.sock.sendall(_HEADER.pack(len(body)))
            self.sock.sendall(body)

    def _recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise DeepxError(f"deepxd at {self.address} closed the connection")
            got += k
        return buf

    def recv_frame(self) -> dict[str, Any]:
        try:
            # most replies arrive whole in one read: take what is there, then read exactly the rest
            first = self.sock.recv(65536)
            if not first:
                raise DeepxError(f"deepxd at {self.address} closed the connection")
            if len(first) < 4:
                first += bytes(self._recv_exact(4 - len(first)))
            (n,) = _HEADER.unpack_from(first)
            have = len(first) - 4
            if have > n:
                raise DeepxError("deepxd sent more than one reply for one request")
            if have == n:
                return msgpack.unpackb(memoryview(first)[4:], raw=False, strict_map_key=False)
            # a large reply (tensor data): one buffer of its size, the rest read straight into it
            body = bytearray(n)
            view = memoryview(body)
            view[:have] = memoryview(first)[4:]
            while have < n:
                k = self.sock.recv_into(view[have:], n - have)
                if k == 0:
                    raise DeepxError(f"deepxd at {self.address} closed the connection")
                have += k
            return msgpack.unpackb(body, raw=False, strict_map_key=False)
        except TimeoutError:
            raise self._timed_out() from None
        except OSError as e:
            raise DeepxError(f"lost the connection to deepxd at {self.address}: {e}") from None

    def _timed_out(self) -> DeepxTimeoutError:
        timeout = self.sock.gettimeout()
        self.sock.close()  # what comes later on it would answer the wrong request
        return DeepxTimeoutError(f"deepxd at {self.address} did not answer within {timeout} s (the client's "
                                 "timeout); the connection is closed: connect again to retry")

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        with self._request_lock:
            return self._request(op, fields)

    def _request(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        rid = next(self._ids)
        try:
            self.send_frame({"id": rid, "op": op, **fields})
        except TimeoutError:  # the daemon does not read what it is sent
            raise self._timed_out() from None
        except OSError as e:
            # the daemon may have refused the frame (too large) and closed: its reply says why
            try:
                reply = self.recv_frame()
            except DeepxTimeoutError:
                raise
            except DeepxError:
                raise DeepxError(f"lost the connection to deepxd at {self.address}: {e}") from None
            raise DeepxError(reply.get("error") or f"lost the connection to deepxd: {e}") from None
        reply = self.recv_frame()
        if reply.get("id") not in (rid, None):
            raise DeepxError(f"reply for request {reply.get('id')} arrived for request {rid}")
        if not reply.get("ok") and op != "run":
            raise DeepxError(reply.get("error") or f"{op} failed")
        return reply

    # -- requests
    def run(self, program: Sequence[Instr], fetch: Sequence[str] = (),
            backwards: Sequence[dict[str, Any]] = ()) -> RunReply:
        """Run `program`, read back `fetch`. `backwards`: backward instructions of the program to expand in place
        (each {index, forward, loss, wrt, grad_loss, prefix, names}; see deepxd's scheduler on_run)."""
        extra: dict[str, Any] = {}
        if backwards:
            extra["backwards"] = [{**b, "forward": [pack_instr_cached(i) for i in b["forward"]]} for b in backwards]
        r = self.request("run", program=[pack_instr_cached(i) for i in program], fetch=list(fetch), **extra)
        if "done" not in r:  # refused before reaching the scheduler (a malformed program)
            return RunReply(False, 0, r.get("error"), -1, 0.0, b"")
        tensors = r.get("tensors")
        return RunReply(bool(r["ok"]), r["done"], r.get("error"), r.get("error_index", -1), r.get("t0", 0.0),
                        r.get("times", b""), r.get("output", []),
                        {k: decode_tensor(v) for k, v in tensors.items()} if tensors else {}, r.get("placement"))

    def fetch(self, *names: str) -> dict[str, np.ndarray]:
        r = self.request("fetch", names=list(names))
        return {k: decode_tensor(v) for k, v in r["tensors"].items()}

    def put(self, name: str, array: np.ndarray, *, heap: bool = False, owner: str = "") -> dict[str, Any]:
        a = np.ascontiguousarray(array)
        data = a.reshape(-1).view(np.uint8).data
        return self.request("put", name=name, dtype=from_numpy(a.dtype), shape=list(array.shape), data=data,
                            heap=heap, owner=owner)["tensor"]

    def admin(self, what: str, **fields: Any) -> Any:
        """A registry query by name (`tensors`, `nodes`, `ops`, ...); `tensors` takes `prefix=`."""
        return self.request("admin", what=what, **fields)["result"]

    def ping(self) -> None:
        self.request("ping")
