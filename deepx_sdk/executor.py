"""Bring your own executor: a process that serves ops to a deepxd node (docs/executor.md).

Subclass `Executor`, give it ops as methods marked with `@op` (or a dict of functions), and `serve` it: it connects
to the node as a client does (its Unix socket, or TCP with the token), registers its ops with their costs, and from
then on runs the instructions the node's scheduler places on it, on numpy arrays, until the node closes the link.

    import numpy as np
    from deepx_sdk.executor import Executor, op

    class Extra(Executor):
        name = "numpy-extra"

        @op(args=["tensor A", "var<int> axis"], returns=["tensor C"], results={"C": "like A"},
            dtypes=["float32", "float64"], cost_us=30)
        def cummax(self, A, axis):         # a new op: declared here, in the node's catalogue while this serves it
            return np.maximum.accumulate(A, axis=axis)

        @op()
        def mul(self, A, B):                # an op of the catalogue: run here where an instruction names this
            return A * B

    Extra().serve("unix:///run/user/1000/deepx/deepxd.sock")    # or "tcp://host:7070", token=...

An op's function takes the instruction's args in order (tensors as read-only numpy arrays, vars and vectors as
values) and returns its result (a tuple for several); a result is cast to the dtype the op's rule gives it, and must
have its shape. An exception is answered as the instruction's error, which the client sees naming the op, its
tensors and this executor; the executor goes on serving. Requests are served one at a time, in order.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from deepx_core.client import NativeClient
from deepx_core.errors import DeepxError
from deepx_core.identity import shm_identity
from deepx_core.ir.dtypes import from_numpy, to_numpy

__all__ = ["Executor", "Op", "op"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass
class Op:
    """One op an executor serves: its function, its cost (microseconds per call, moving its tensors included; None:
    placed here only where nothing else serves the op, or where an instruction names this executor), and, for an op
    the node's catalogue lacks, its declaration: `args` and `returns` (`tensor A`, `var X` or `var<int> X`, `vector
    V`), `results` (per return: `like ARG`, or {"shape": [dims], "dtype": ...} with dims as numbers, `ARG.k` or a
    var or vector arg's name), `dtypes` (what its tensors may be) and `doc`."""

    fn: Callable[..., Any]
    cost_us: float | None = None
    args: list[str] | None = None
    returns: list[str] | None = None
    results: dict[str, Any] | None = None
    dtypes: list[str] | None = None
    doc: str = ""

    def entry(self, name: str) -> dict[str, Any]:
        """Its entry in the registration's `ops`."""
        out: dict[str, Any] = {"name": name}
        if self.cost_us is not None:
            out["cost_us"] = float(self.cost_us)
        if self.returns is not None:
            out.update(args=list(self.args or []), returns=list(self.returns), results=dict(self.results or {}))
            if self.dtypes is not None:
                out["dtypes"] = list(self.dtypes)
            if self.doc:
                out["doc"] = self.doc
        return out


def op(name: str | None = None, *, cost_us: float | None = None, args: list[str] | None = None,
       returns: list[str] | None = None, results: dict[str, Any] | None = None, dtypes: list[str] | None = None,
       doc: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method of an Executor as the op `name` (default: the method's name); see `Op` for the rest."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        spec = Op(fn, cost_us, args, returns, results, dtypes, doc or (fn.__doc__ or "").strip().split("\n")[0])
        fn._deepx_op = (name or fn.__name__, spec)  # type: ignore[attr-defined]
        return fn

    return mark


@dataclass
class _Frames:
    """Frames read from a socket: several to a read where they come so (the node may send a call while another's
    reply is on its way), a large one received straight into a buffer of its size."""

    sock: socket.socket
    buf: bytearray = field(default_factory=bytearray)

    def read(self) -> dict[str, Any] | None:
        """The next frame; None where the node closed the connection."""
        while len(self.buf) < 4:
            if not self._more():
                return None
        (n,) = _HEADER.unpack_from(self.buf)
        if len(self.buf) - 4 >= n:
            body: bytearray | memoryview = self.buf[4:4 + n]
            del self.buf[:4 + n]
        else:
            body = bytearray(n)
            view = memoryview(body)
            have = len(self.buf) - 4
            view[:have] = memoryview(self.buf)[4:]
            self.buf = bytearray()
            while have < n:
                try:
                    k = self.sock.recv_into(view[have:], n - have)
                except OSError:
                    return None
                if not k:
                    return None
                have += k
        frame = msgpack.unpackb(body, raw=False, strict_map_key=False)
        if not isinstance(frame, dict):
            raise DeepxError(f"the node sent a frame that is not a map: {str(frame)[:80]}")
        return frame

    def _more(self) -> bool:
        try:
            chunk = self.sock.recv(1 << 16)
        except OSError:
            return False
        self.buf += chunk
        return bool(chunk)


class Executor:
    """The base of an executor (see the module's doc). `name`: how the node and deepxctl call it (the class
    attribute, or the constructor's; default: the class's name); `ops`: more ops, by name (a function, or an `Op`)."""

    name: str = ""

    def __init__(self, name: str | None = None, ops: Mapping[str, Callable[..., Any] | Op] | None = None) -> None:
        self.name = name or self.name or type(self).__name__.lower()
        self.ops: dict[str, Op] = {}
        for attr in dir(type(self)):
            marked = getattr(getattr(type(self), attr, None), "_deepx_op", None)
            if marked is not None:
                op_name, spec = marked
                self.ops[op_name] = Op(**{**spec.__dict__, "fn": getattr(self, attr)})
        for op_name, fn in (ops or {}).items():
            self.ops[op_name] = fn if isinstance(fn, Op) else Op(fn)
        self.client: NativeClient | None = None
        self.node = ""  # the node served, once registered
        self.calls = 0  # instructions run
        self.attached = 0  # input tensors read where they lie, in the node's shared memory (not sent)

    def registration(self) -> dict[str, Any]:
        """The `executor_register` request's fields."""
        return {"name": self.name, "ops": [o.entry(n) for n, o in sorted(self.ops.items())], "shm": shm_identity()}

    def serve(self, address: str | None = None, *, token: str | None = None, tls: bool | None = None,
              cafile: str | None = None) -> None:
        """Connect to the node at `address` (as NativeClient does: DEEPX_ADDRESS or the default socket where None;
        TCP asks for `token`, else DEEPX_TOKEN), register, and run what it sends until it closes the connection (it
        stopped) or `stop()` is called. DeepxError where the node refuses the registration (a name taken, an op
        declared otherwise, ...)."""
        if not self.ops:
            raise DeepxError(f"executor {self.name!r} serves no op: mark methods with @op, or give ops=")
        client = NativeClient(address, token=token, tls=tls, cafile=cafile, name=f"executor {self.name}")
        self.client = client
        try:
            # (its own reader from here: a call may follow the registration's reply in the same read)
            frames = _Frames(client.sock)
            client.send_frame({"id": 0, "op": "executor_register", **self.registration()})
            reply = frames.read()
            if reply is None or not reply.get("ok"):
                why = "it closed the connection" if reply is None else reply.get("error")
                raise DeepxError(f"the node at {client.address} refused executor {self.name!r}: {why}")
            self.node = str(reply.get("node", ""))
            log.info("executor %r serves node %s at %s: %s", self.name, self.node, client.address,
                     ", ".join(reply.get("ops", ())))
            while True:
                req = frames.read()
                if req is None:
                    log.info("executor %r: node %s closed the connection", self.name, self.node)
                    return
                client.send_frame(self.answer(req))
        except OSError as e:
            log.info("executor %r: the connection to %s ended: %s", self.name, client.address, e)
        finally:
            client.close()
            self.client = None

    def stop(self) -> None:
        """End `serve` (from another thread, or a signal handler): its connection is shut down."""
        client = self.client
        if client is not None:
            try:
                client.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def answer(self, req: dict[str, Any]) -> dict[str, Any]:
        """The reply to one request of the node: {id, ok, returns} or {id, ok: false, error}."""
        rid = req.get("id")
        if req.get("op") != "execute":
            return {"id": rid, "ok": False, "error": f"executor {self.name!r} does not know request {req.get('op')!r}"}
        try:
            return {"id": rid, "ok": True, "returns": self.execute(req)}
        except Exception as e:  # the instruction's error, for the client; this executor goes on
            log.warning("executor %r: %s failed", self.name, req.get("text", "an instruction"), exc_info=True)
            return {"id": rid, "ok": False, "error": f"{type(e).__name__}: {e}" if not isinstance(e, DeepxError)
                    else str(e)}

    def execute(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        """Run one `execute` request: its op's function on its args; its results, cast and checked against what the
        instruction's returns ask."""
        instr = req.get("instr")
        name = instr[0] if isinstance(instr, list) and instr else None
        entry = self.ops.get(name) if isinstance(name, str) else None
        if entry is None:
            raise DeepxError(f"executor {self.name!r} does not serve op {name!r}")
        args = [self._value(a) for a in req.get("args", ())]
        self.calls += 1
        out = entry.fn(*args)
        results = list(out) if isinstance(out, tuple) else [out]
        returns = req.get("returns", [])
        if len(results) != len(returns):
            raise DeepxError(f"{name} returned {len(results)} results; the instruction writes {len(returns)} "
                             f"({', '.join(repr(r.get('tensor')) for r in returns)})")
        answered = []
        for r, want in zip(results, returns):
            a = np.asarray(r)
            if "dtype" in want:
                a = a.astype(to_numpy(want["dtype"]), copy=False)
            if "shape" in want and list(a.shape) != list(want["shape"]):
                raise DeepxError(f"{name} returned shape {list(a.shape)} for '{want.get('tensor')}'; the op's rule "
                                 f"says {list(want['shape'])}")
            flat = np.ascontiguousarray(a).reshape(-1)
            answered.append({"dtype": from_numpy(a.dtype), "shape": list(a.shape), "data": flat.view(np.uint8).data})
        return answered


    def _value(self, arg: dict[str, Any]) -> Any:
        """An arg as the function takes it: a tensor as a read-only array (its bytes, or the node's shared memory
        mapped), else its value."""
        if "tensor" not in arg:
            return arg.get("value")
        dtype, shape = to_numpy(arg["dtype"]), tuple(int(d) for d in arg["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if "handle" in arg:
            self.attached += 1
            return _attached(str(arg["handle"]), dtype, shape, count)
        return np.frombuffer(arg["data"], dtype=dtype, count=count).reshape(shape)


def _attached(handle: str, dtype: np.dtype[Any], shape: tuple[int, ...], count: int) -> np.ndarray:
    """A heap tensor of the node, read where it lies: its shared-memory segment mapped read-only."""
    if not _SEGMENT.match(handle):
        raise DeepxError(f"the node sent a segment name that is not one: {handle!r}")
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    with open(os.path.join("/dev/shm", handle), "rb") as f:
        mapped = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
    return np.frombuffer(mapped, dtype=dtype, count=count).reshape(shape)
