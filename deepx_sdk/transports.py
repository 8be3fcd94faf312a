"""How a session's programs reach an executor: the transports.

- embedded (the default): a deepxd node inside this process, on its own event loop in a background thread;
- `unix:///path`: a running deepxd over the native protocol; `tcp://host:port` the same over TCP (a token, TLS);
- `udp://host:port`: deepxIR text to any deepx executor (eager; values cannot be read back).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr
from deepx_core.ir.text import format_text

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What a transport reports for one program."""

    ok: bool
    done: int
    error: str | None
    error_index: int
    tensors: dict[str, np.ndarray]
    output: list[str]
    placement: dict[str, Any] | None = None  # run across nodes: where each instruction ran, what moved


class Transport:
    #: whether run() takes `backwards`: `loss.backward()` recorded into the program (see Recorder.record_backward)
    takes_backwards = False

    def run(self, program: Sequence[Instr], fetch: Sequence[str]) -> Outcome:
        raise DeepxError(f"{type(self).__name__} cannot run programs")

    def put(self, name: str, array: np.ndarray, heap: bool) -> None:
        raise DeepxError(f"{type(self).__name__} cannot send tensor data")

    def backward(self, forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None,
                 prefix: str, names: dict[str, str] | None = None) -> dict[str, str]:
        raise DeepxError(f"{type(self).__name__} cannot run backward: gradients need a deepxd (unix://, tcp:// or "
                         "embedded)")

    def label(self, prefix: str | None, tensors: dict[str, dict[str, str]] | None) -> None:
        """Tell the daemon what the session knows of its tensors (deepx_sdk/labels.py): `prefix`, the names its
        tensors are made under; `tensors`, their labels. Where there is no daemon (UDP), nothing."""

    def group(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        """A process-group request of deepx_sdk.distributed (`join`, `barrier`, `leave`: deepxd/groups.py)."""
        raise DeepxError(f"{type(self).__name__} cannot form process groups: they need a deepxd (unix:// or embedded)")

    #: the device the session's tensors live on where the daemon said (`place`); "" where it did not
    placed = ""

    def place(self, device: str, local_rank: int | None = None) -> str:
        """Run this session on `device` ("cuda:N") of a daemon with several GPUs, or "auto": the GPU of
        `local_rank` (init_process_group's choice, taken only before the session made anything). The device."""
        raise DeepxError(f"device={device!r}: {type(self).__name__} runs where its daemon runs (a running deepxd "
                         "places sessions on its GPUs)")

    def close(self) -> None:
        pass

    def where(self) -> tuple[str, str]:
        """The node programs are sent to and the op worker that holds its tensors ("" where unknown: UDP)."""
        return "", ""

    can_read = True
    explicit_broadcast = False


class NativeTransport(Transport):
    def __init__(self, address: str, name: str | None = None, **remote: Any) -> None:
        from deepx_sdk.client import NativeClient

        self.client = NativeClient(address, client="deepx_sdk", name=name, **remote)
        self.address = address
        self.remote = remote  # token, TLS: how another process of this program connects (DataLoader workers)

    takes_backwards = True

    def run(self, program: Sequence[Instr], fetch: Sequence[str], backwards: Sequence[dict[str, Any]] = ()
            ) -> Outcome:
        r = self.client.run(program, fetch, backwards)
        return Outcome(r.ok, r.done, r.error, r.error_index, r.tensors, r.output, r.placement)

    def where(self) -> tuple[str, str]:
        server = self.client.server
        return str(server.get("node", "")), "op-cuda" if "op-cuda" in (server.get("roles") or ()) else "op-cpu"

    def put(self, name: str, array: np.ndarray, heap: bool) -> None:
        self.client.put(name, array, heap=heap)

    def backward(self, forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None,
                 prefix: str, names: dict[str, str] | None = None) -> dict[str, str]:
        from deepx_core.ir.wire import pack_instr_cached

        r = self.client.request("backward", forward=[pack_instr_cached(i) for i in forward], loss=loss,
                                wrt=list(wrt), grad_loss=grad_loss, prefix=prefix, names=names)
        return dict(r["grads"])

    def label(self, prefix: str | None, tensors: dict[str, dict[str, str]] | None) -> None:
        fields: dict[str, Any] = {}
        if prefix is not None:
            fields["prefix"] = prefix
        if tensors:
            fields["tensors"] = tensors
        self.client.request("label", **fields)

    def group(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        from deepx_core.ir.wire import pack_instr_cached

        for program in ("before", "then"):
            if fields.get(program):
                fields = {**fields, program: [pack_instr_cached(i) for i in fields[program]]}
        reply = self.client.request(f"group_{op}", **fields)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    def place(self, device: str, local_rank: int | None = None) -> str:
        fields: dict[str, Any] = {"device": device}
        if local_rank is not None:
            fields["local_rank"] = local_rank
        self.placed = str(self.client.request("place", **fields)["device"])
        return self.placed

    def close(self) -> None:
        self.client.close()


class EmbeddedTransport(Transport):
    """A deepxd node in this process: the same actors, on an event loop in a background thread. Programs go to its
    scheduler directly (no socket, no serialization); it also listens on a private socket for deepxctl.

    Its roles: `roles`, else DEEPX_ROLES, else registry, heapmem, scheduler and op-cpu; naming op-cuda (e.g.
    DEEPX_ROLES=op-cuda) runs the session on the GPU."""

    def __init__(self, roles: Sequence[str] | None = None, name: str | None = None) -> None:
        from deepx_core.paths import private_socket_dir
        from deepx_sdk.loopthread import NOT_NOW, LoopThread  # here: asyncio is not imported until it is needed
        from deepxd.embedded import EmbeddedNode

        sock = private_socket_dir() / f"embedded-{os.getpid()}-{id(self)}.sock"
        if roles is None:
            env = os.environ.get("DEEPX_ROLES", "")
            roles = [r.strip() for r in env.split(",") if r.strip()] or None
        self.runner = LoopThread("deepx-embedded")
        self.not_now = NOT_NOW
        self.loop = self.runner.loop
        # the kernel choices a daemon reads from its config come from the environment here (DEEPX_BLAS,
        # DEEPX_NATIVE_KERNELS), as a daemon's do
        self.embedded: Any = None

        async def start() -> None:
            self.embedded = EmbeddedNode(str(sock), f"embedded-{os.getpid()}", roles,
                                         blas=os.environ.get("DEEPX_BLAS", "auto").strip().lower() or "auto",
                                         native_kernels=os.environ.get("DEEPX_NATIVE_KERNELS", "1").strip() != "0",
                                         name=name)
            await self.embedded.start()

        try:
            self.runner.start(start)
        except BaseException as e:
            raise DeepxError(f"the embedded deepxd did not start: {e}") from e
        self.thread = self.runner.thread
        self.address = f"unix://{sock}"

    @property
    def node(self) -> Any:
        """The embedded deepxd node itself (deepxd.node.Node), for inspection; requests go through `embedded`."""
        return self.embedded.node

    def _call(self, coro: Any) -> Any:
        if not self.runner.alive():
            coro.close()
            raise DeepxError("the embedded deepxd has stopped; call dx.connect() again")
        return self.runner.call(coro)

    takes_backwards = True

    def run(self, program: Sequence[Instr], fetch: Sequence[str], backwards: Sequence[dict[str, Any]] = ()
            ) -> Outcome:
        program, fetch, marks = list(program), list(fetch), list(backwards) or None
        # a step the scheduler has run before, straight to the worker with no event loop step where it can be
        # (Scheduler.now_run); else the ask, as any other
        e = self.embedded
        r = self.now_or_ask(e.now_run, (program, fetch, marks), lambda: e.run(program, fetch, marks))
        return Outcome(not r.error, r.done, r.error or None, r.error_index, r.tensors, r.output)

    def now_or_ask(self, now: Any, args: tuple[Any, ...], ask: Any) -> Any:
        """now(*args) on this thread with the loop borrowed (LoopThread.now: an actor's way to answer with no event
        loop step); where it answers None (not its case) the coroutine ask() makes, as _call runs it; where the loop
        is not to be borrowed, that coroutine sent to the loop's thread at once (call would find the same)."""
        if not self.runner.alive():
            raise DeepxError("the embedded deepxd has stopped; call dx.connect() again")
        r = self.runner.now(now, *args)
        if r is self.not_now:
            return self.runner.send(ask())
        if r is None:
            return self._call(ask())
        return r

    def put(self, name: str, array: np.ndarray, heap: bool) -> None:
        self._call(self.embedded.put(name, array, heap))

    def where(self) -> tuple[str, str]:
        config = self.embedded.config
        return config.node_id, "op-cuda" if "op-cuda" in config.roles else "op-cpu"

    def label(self, prefix: str | None, tensors: dict[str, dict[str, str]] | None) -> None:
        self._call(self.embedded.label(prefix, tensors))

    def backward(self, forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None,
                 prefix: str, names: dict[str, str] | None = None) -> dict[str, str]:
        return dict(self._call(self.embedded.backward(forward, loss, wrt, grad_loss, prefix, names))["grads"])

    def group(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call(self.embedded.group(op, fields)))

    def place(self, device: str, local_rank: int | None = None) -> str:
        """An embedded daemon drives one GPU (DEEPX_CUDA_DEVICE's): "auto" and that one are taken, another refused."""
        c = self.embedded.config
        mine = f"cuda:{c.cuda_device}" if "op-cuda" in c.roles else "cpu"
        if device not in ("auto", mine, mine.removeprefix("cuda:")):
            raise DeepxError(f"device={device!r}: this session's daemon is embedded and runs on {mine}; choose its GPU "
                             "with DEEPX_CUDA_DEVICE (and roles=['op-cuda']), or connect to a deepxd with several")
        return mine

    def close(self) -> None:
        if self.runner.alive():
            try:
                self.runner.send(self.embedded.shutdown(), 30)
            except Exception as e:
                log.warning("embedded deepxd: shutdown failed: %s", e)
        self.runner.stop(10)


class UdpTransport(Transport):
    """deepxIR text over UDP to any deepx executor, one line at a time, waiting for each reply (as the existing
    front end does). There is no way to read values back."""

    can_read = False
    explicit_broadcast = True

    def __init__(self, address: str, timeout: float = 30.0) -> None:
        import socket

        host, _, port = address.removeprefix("udp://").rpartition(":")
        try:
            self.target = (host.strip("[]") or "127.0.0.1", int(port))
        except ValueError:
            raise DeepxError(f"bad address {address!r}: use udp://host:port") from None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.settimeout(timeout)
        self.address = address

    def run(self, program: Sequence[Instr], fetch: Sequence[str]) -> Outcome:
        if fetch:
            raise DeepxError(f"cannot read tensor values over {self.address}: deepxIR over UDP has no way back for "
                             "data; connect to a deepxd over unix:// (or embedded) to read values")
        for i, instr in enumerate(program):
            self.sock.sendto(format_text(instr).encode(), self.target)
            try:
                reply = self.sock.recv(65536).decode(errors="replace")
            except OSError as e:
                raise DeepxError(f"no reply from {self.address} for {instr.name}: {e}") from None
            head, _, rest = reply.partition("//")
            if head.split()[-1:] != ["ok"]:
                msg = rest.split("finish_at=", 1)[-1].split(" ", 1)[-1] if "finish_at=" in rest else reply
                return Outcome(False, i, msg.strip(), i, {}, [])
        return Outcome(True, len(program), None, -1, {}, [])

    def close(self) -> None:
        self.sock.close()


def open_transport(address: str | None, roles: Sequence[str] | None = None, name: str | None = None, *,
                   token: str | None = None, tls: bool | None = None, cafile: str | None = None) -> Transport:
    """The transport for `address` (else DEEPX_ADDRESS, else embedded); `name`: the session's name as deepxctl shows
    it (default: the program's). `token`, `tls`, `cafile`: a tcp:// daemon's (NativeClient reads DEEPX_TOKEN,
    DEEPX_TOKEN_FILE, DEEPX_TLS and DEEPX_TLS_CAFILE where they are not given)."""
    address = address or os.environ.get("DEEPX_ADDRESS") or ""
    remote = {k: v for k, v in (("token", token), ("tls", tls), ("cafile", cafile)) if v is not None}
    given = [k for k, v in remote.items() if v]  # tls=False asks for nothing
    if given and not address.startswith("tcp://"):
        raise DeepxError(f"{' and '.join(f'{k}=' for k in given)} given, but {address or 'the embedded daemon'} is "
                         "not a tcp://host:port address: a token and TLS are for a deepxd's TCP listener (its Unix "
                         "socket asks for neither)")
    if not address or address == "embedded":
        return EmbeddedTransport(roles, name)
    if roles is not None:
        raise DeepxError(f"roles={list(roles)!r} picks the roles of an embedded daemon; {address} runs its own "
                         "(start it with deepxd start --role=...)")
    if address.startswith("unix://"):
        return NativeTransport(address, name)
    if address.startswith("tcp://"):
        return NativeTransport(address, name, **remote)
    if address.startswith("udp://"):
        return UdpTransport(address)
    raise DeepxError(f"unknown address {address!r}: use unix:///path, tcp://host:port, udp://host:port, or nothing "
                     "for embedded")
