"""A session: what tensors record into and read from.

It composes its parts, each in its own module: the transport that runs programs (transports.py), the recorder that
holds the pending program and sends it (recorder.py), the pool of tensor names (names.py) and the autograd tape
(tape.py).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (registers its exit hook first, so that ours, below, runs before it)
import itertools
import logging
import os
import secrets
import threading
from collections.abc import Sequence

import numpy as np

from deepx_core.errors import DeepxError
from deepx_sdk.labels import Labels, all_callsites
from deepx_sdk.names import NamePool
from deepx_sdk.recorder import Recorder, call_site
from deepx_sdk.tape import Tape
from deepx_sdk.transports import NativeTransport, Transport, open_transport

log = logging.getLogger(__name__)


class _GradMode(threading.local):
    """A thread's grad mode: on unless set (a class default, so that reading it where no thread set it is a plain
    attribute read: every op that requires grad reads it)."""

    on = True


class Session:
    """Records instructions and runs them through a transport when a value is needed: the parts do the work
    (docs/layout.md), the session holds them together, with closing, the grad mode and the random seed."""

    def __init__(self, transport: Transport, *, max_pending: int = 4096) -> None:
        self._lock = threading.RLock()  # one flush, backward or capture at a time
        # tensor names are unique across the clients of one daemon: a prefix of this process and session
        self.names = NamePool(f"x{os.getpid():x}{secrets.token_hex(2)}_")
        # what deepxctl shows of the session's tensors: parameters' module paths and where they were made
        self.labels = Labels(call_site, all_callsites())
        self.recorder = rec = Recorder(transport, self.names, self._lock, max_pending, self.labels)
        self.tape = Tape()  # the autograd graph, on the tensors themselves (each result's grad_fn)
        # read on the recording hot path (tensor._emit) from the session itself, with no hop (decision 0025): the
        # recorder's lists (never replaced), its bound, and whether broadcasting is sent as broadcastTo instructions
        self.pending, self.origins, self.collected = rec.pending, rec.origins, rec.collected
        self.max_pending = max_pending
        self.explicit_broadcast = transport.explicit_broadcast
        self._grad_mode = _GradMode()  # grad_enabled, per thread as torch's (no_grad in one thread is its own)
        self.seed_counter = itertools.count(1)
        self.device_chosen = False  # dx.connect(device=...) placed it: init_process_group does not move it
        self.base_seed: int | None = None
        self._pid = os.getpid()  # a forked child inherits the session: its exit must not close the parent's
        # on a running deepxd, close() (and the interpreter's exit) deletes what the session made (dx.connect(...,
        # release=False) keeps it, for deepxctl to look at afterwards)
        self._release_on_close = True
        if isinstance(transport, NativeTransport):
            self._bind_release(True)
        try:  # the daemon shows the tensors named under the prefix as this session's
            transport.label(self.names.prefix, None)
        except DeepxError as e:  # a deepxd from before labels: none is sent
            self.labels.enabled = False
            log.debug("label: %s", e)

    @property
    def transport(self) -> Transport:
        """Where programs go (during a dx.compile capture, the capture's stand-in)."""
        return self.recorder.transport

    @property
    def closed(self) -> bool:
        return self.recorder.closed

    @property
    def grad_enabled(self) -> bool:
        """Whether operations of this thread record gradients (dx.no_grad and the like set it, per thread)."""
        return self._grad_mode.on  # type: ignore[no-any-return]

    @grad_enabled.setter
    def grad_enabled(self, on: bool) -> None:
        self._grad_mode.on = on

    def sync(self, fetch: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """Send what is pending (with `fetch` read back); raise the first error since the last sync."""
        return self.recorder.sync(fetch)

    def flush_full(self) -> None:
        """Send the pending program because it reached max_pending; an error is kept for the next sync."""
        self.recorder.flush_full()

    def empty_cache(self) -> None:
        """Delete the pooled temporaries (they are kept for reuse, at most pool_per_shape per shape and dtype)."""
        self.recorder.empty_cache()

    @property
    def release_on_close(self) -> bool:
        """Whether closing the session deletes what it made on a running deepxd (dx.connect's `release`). The
        daemon is told too, so that it does the same where the process ends without closing the session (a kill, a
        SIGTERM that skips the interpreter's exit)."""
        return self._release_on_close

    @release_on_close.setter
    def release_on_close(self, on: bool) -> None:
        if bool(on) != self._release_on_close and isinstance(self.transport, NativeTransport):
            self._bind_release(bool(on))
        self._release_on_close = bool(on)

    def _bind_release(self, on: bool) -> None:
        try:
            self.transport.client.request(  # type: ignore[attr-defined]
                "release_on_close", prefix=self.names.prefix if on else "")
        except DeepxError as e:  # a deepxd from before this request: the session's own close still releases
            log.debug("release_on_close: %s", e)

    def close(self) -> None:
        if self.recorder.closed:
            return
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker, a Pool) at its exit: the parent's session
            self.recorder.abandon()
            return
        self.recorder.close(release=self.release_on_close and isinstance(self.transport, NativeTransport))


_current: Session | None = None
_current_lock = threading.Lock()


def connect(address: str | None = None, *, max_pending: int = 4096, roles: Sequence[str] | None = None,
            release: bool = True, token: str | None = None, tls: bool | None = None, cafile: str | None = None,
            name: str | None = None, device: str | None = None) -> Session:
    """Connect to deepx: `address` None (and no DEEPX_ADDRESS) starts an embedded daemon in this process (with
    `roles`, else DEEPX_ROLES, else the CPU roles: `roles=["op-cuda"]` runs it on the GPU); `unix:///path` reaches a
    running deepxd; `tcp://host:port` one on another machine (`token`, else DEEPX_TOKEN or DEEPX_TOKEN_FILE; `tls`
    or `cafile` for its TLS listener); `udp://host:port` speaks deepxIR text to any deepx executor. `release`: on a
    running deepxd, closing the session (or the interpreter's exit) deletes the tensors it made and lets go of its
    compiled graphs' plans; False leaves them there (for `deepxctl tensors ls` after the script). `name`: the
    session's name where deepxctl shows who owns a tensor (default: the program's file name). `device` (else
    DEEPX_DEVICE): the GPU ("cuda:1") of a deepxd with several that this session's tensors live on (default: its
    first; init_process_group picks one by LOCAL_RANK where none was chosen: docs/distributed.md)."""
    global _current
    device = device or os.environ.get("DEEPX_DEVICE") or None
    with _current_lock:
        if _current is not None:
            _current.close()
        transport = open_transport(address, roles, name, token=token, tls=tls, cafile=cafile)
        if device is not None:
            try:
                transport.place(str(device))
            except BaseException:
                transport.close()
                raise
        _current = Session(transport, max_pending=max_pending)
        _current.release_on_close = release
        _current.device_chosen = device is not None
        return _current


def disconnect() -> None:
    global _current
    with _current_lock:
        if _current is not None:
            _current.close()
            _current = None


def session() -> Session:
    """The current session; connects with the defaults on first use."""
    s = _current
    if s is None or s.closed:
        return connect()
    return s


# The last program must run before concurrent.futures stops taking work at exit (the op workers' threads, the CUDA
# thread above all): threading's exit hooks run before atexit's, latest first, and concurrent.futures registered its
# own when this module imported it. atexit stays as the fallback (disconnect twice is harmless).
_register_threading_atexit = getattr(threading, "_register_atexit", None)
if _register_threading_atexit is not None:
    _register_threading_atexit(disconnect)
atexit.register(disconnect)
