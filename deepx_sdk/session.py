"""A session: where instructions are recorded, and the transport that runs them (deepx_sdk/transports.py).

Tensor operations append instructions to the session's pending program; it is sent as one frame when a value is
read, at `dx.sync()`, or when it grows past `max_pending`. The autograd graph is recorded on the tensors themselves
(deepx_sdk/tape.py).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures.thread  # noqa: F401  (registers its exit hook first, so that ours, below, runs before it)
import itertools
import logging
import os
import secrets
import sys
import threading
from bisect import insort
from collections.abc import Collection, Mapping, Sequence
from types import CodeType
from typing import Any

import numpy as np

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, Param
from deepx_sdk.lazy_backward import LazyBackward
from deepx_sdk.tape import Tape
from deepx_sdk.transports import NativeTransport, Outcome, Transport, open_transport

log = logging.getLogger(__name__)

_SDK_DIR = os.path.dirname(os.path.abspath(__file__))
# id(code object) -> (the code object, whether it is the SDK's own): recording walks past the SDK's frames to the
# user's line. By id, because hashing a code object hashes its contents; the entry holds the code object, so its
# id is never reused while the entry stands (notebook cells make new code objects: the memo is bounded)
_IN_SDK: Cache[int, tuple[CodeType, bool]] = Cache("sdk.in_sdk", 65536, counted=False)


def in_sdk(code: CodeType) -> tuple[CodeType, bool]:
    """(code, whether it is the SDK's own), remembered in _IN_SDK."""
    return _IN_SDK.put(id(code), (code, code.co_filename.startswith(_SDK_DIR)))


def _name_order(name: str) -> tuple[int, str]:
    """A session's names are its prefix and a number: by length, then text, is by number."""
    return len(name), name


#: deltensor instructions by (name, dtype): a loop deletes the same names every step, and the same objects then
#: cost nothing to make and compare at identity speed (same_program)
_DELETIONS: Cache[tuple[str, Any], Instr] = Cache("sdk.deletions", 16384, counted=False)


def _deletion(name: str, dtype: Any) -> Instr:
    key = (name, dtype)
    instr = _DELETIONS.get(key)
    if instr is None:
        instr = _DELETIONS.put(key, Instr("deltensor", (), (Param("tensor", (dtype,), name),)))
    return instr


def origin(f: Any) -> Any:
    """The entry of Session.origins for frame `f`: the first frame from it outwards that is not the SDK's, as
    id(code) << 24 | offset (an int: nothing for the garbage collector to track), or (code, offset)."""
    while f is not None:
        code = f.f_code
        known = _IN_SDK.get(id(code))
        if known is None:
            known = in_sdk(code)
        if not known[1]:
            lasti = f.f_lasti
            return id(code) << 24 | lasti if lasti < 16777216 else (code, lasti)
        f = f.f_back
    return None


def origin_of(entry: Any) -> tuple[CodeType, int] | None:
    """(code, offset) of an entry of Session.origins: a tuple, or id(code) << 24 | offset (the code object then
    found in _IN_SDK, which holds it); None where unknown."""
    if type(entry) is int:
        known = _IN_SDK.get(entry >> 24)
        return (known[0], entry & 0xFFFFFF) if known is not None else None
    return entry


def source_line(code: CodeType, offset: int) -> int | None:
    """The line of `code` whose bytecode holds byte `offset` (a frame's f_lasti)."""
    line = None
    for start, end, n in code.co_lines():
        if start <= offset < end:
            return n
        if start <= offset and n is not None:
            line = n
    return line if line is not None else code.co_firstlineno


class Session:
    """Records instructions and runs them through a transport when a value is needed."""

    def __init__(self, transport: Transport, *, max_pending: int = 4096) -> None:
        self.transport = transport
        # the transport's: whether broadcasting is sent as broadcastTo instructions (read on the recording hot path)
        self.explicit_broadcast = transport.explicit_broadcast
        self.pending: list[Instr] = []
        self.origins: list[tuple[CodeType, int] | int | None] = []  # see origin_of
        self.max_pending = max_pending
        self.error: DeepxError | None = None
        self._names = itertools.count()
        # tensor names are unique across the clients of one daemon: a prefix of this process and session
        self._prefix = f"x{os.getpid():x}{secrets.token_hex(2)}_"
        self._pid = os.getpid()  # a forked child inherits the session: its exit must not close the parent's
        self._lock = threading.RLock()
        self.closed = False
        self._grad_mode = threading.local()  # grad_enabled, per thread as torch's (no_grad in one thread is its own)
        self.seed_counter = itertools.count(1)
        self.base_seed: int | None = None
        # records the autograd graph on the tensors themselves (each result's grad_fn; see Tape)
        self.tape = Tape()
        # gradient names: f"{_grad_root}{k}_{i}" for backward k; k is taken again once every gradient handle of the
        # backward that had it is gone (deleted in the daemon), so a training step sends the same backward request
        # every time and the daemon's caches see a repeat. Those names are never pooled (see _drain_collected)
        self._grad_root = f"{self._prefix}g"
        self._grad_live: dict[int, int] = {}
        # names numbered above _mark were made since the last flush; _lost: tensors whose creating instruction never
        # ran (a program failed before it), which Python must not delete
        self._mark = -1
        self._lost: set[str] = set()
        # (name, dtype) of handles Python collected: appended without a lock (garbage collection runs in any thread,
        # the embedded daemon's too, while another holds the lock), sent as deltensor with the next program
        self.collected: collections.deque[tuple[Any, ...]] = collections.deque()
        # stored graphs of compiled functions Python collected, appended the same way: the next flush has the daemon
        # let go of their plans and kept temporaries (compile._drop_when_gone)
        self.graph_drops: collections.deque[str] = collections.deque()
        self.graphs_made: set[str] = set()  # graphs this session stored or took from the plane (see close)
        # on a running deepxd, close() (and the interpreter's exit) deletes what the session made (dx.connect(...,
        # release=False) keeps it, for deepxctl to look at afterwards)
        self._release_on_close = True
        if isinstance(transport, NativeTransport):
            self._bind_release(True)
        # names of collected temporaries kept for reuse, by (shape, dtype): the next result of that shape and dtype
        # takes one, so a loop sends the same instructions every step (the daemon's checks are then cached, and
        # it writes into the buffer it already has) and needs no deltensor at all
        self.pool: dict[tuple[Any, str], list[str]] = {}
        self.pool_per_shape = 16
        # deleted names kept for reuse per shape and dtype (names only, no buffers: a model that makes a few dozen
        # large results of one shape every step, a transformer's (batch, length, width), names them alike each step)
        self.freed_per_shape = 256
        # names of collected transposes (Tensor._k with a fourth item): deleted in the daemon, and kept for reuse
        # by (shape, dtype) all the same, so that a loop names its transposes the same way every step. A name
        # handed out from here is in _revived until the program that makes its tensor has run (see _forget_unrun)
        self.freed: dict[tuple[Any, str], list[str]] = {}
        # names deleted by the pending program: handed out again only once it has gone, so that a name is never
        # written again by the program that deleted it (a later value in a dead one's name would keep the daemon's
        # fuse pass from joining the op that wrote the dead value to the op that read it)
        self._freed_now: dict[tuple[Any, str], list[str]] = {}
        self._revived: set[str] = set()
        # names the pending program's results took from the pool (or from the handle they replace): their tensors
        # hold an older value in the daemon until the program runs, so one that never ran must not be read (see
        # _forget_unrun)
        self._reused: set[str] = set()
        # per name handed out to a result since the last flush (reuse_name, freed_name, a loop's replaced handle):
        # where in `pending` its instruction stands, the last time it was handed out (see _forget_unrun)
        self._taken: dict[str, int] = {}
        # such names whose deletion is pending (in _lost as well): sent again, not dropped, where it does not run
        self._stale: set[str] = set()
        # the last failed program's error, for a later read of a tensor it never made (see sync)
        self._failure = ""
        # (instruction, undo) pairs of the pending program: where the instruction does not run, undo() puts back
        # what Python counted when it was recorded (an optimizer's step count: see undo_unrun)
        self._undo: list[tuple[Instr, Any]] = []
        # set by dx.compile while it captures a call (deepx_sdk/compile.py): reading a value then is refused
        self.capture: Any = None
        # programs, backward requests and graph replays sent so far: a value read back along with one of them
        # (Tensor._v, a replay's small outputs) is the tensor's value for as long as no other has been sent
        self.runs = 0
        # backward instructions in `pending` (record_backward): what the daemon expands each into, with its index
        self.backwards: list[dict[str, Any]] = []
        # whether a backward is recorded into the program or sent on its own (deepx_sdk/lazy_backward.py)
        self.lazy = LazyBackward()

    @property
    def grad_enabled(self) -> bool:
        """Whether operations of this thread record gradients (dx.no_grad and the like set it, per thread)."""
        return getattr(self._grad_mode, "on", True)

    @grad_enabled.setter
    def grad_enabled(self, on: bool) -> None:
        self._grad_mode.on = on

    def new_name(self) -> str:
        return f"{self._prefix}{next(self._names)}"

    def record(self, instr: Instr) -> None:
        """Append an instruction; remember which line of user code made it (its code object and the offset of the
        call in it: the line number is worked out only when an error names it)."""
        self.record_at(instr, origin(sys._getframe(1)))

    def record_at(self, instr: Instr, where: Any) -> None:
        """record(), with the user's line already found (`where`: an origin() entry, None where unknown): an
        optimizer's step looks it up once for all its updates."""
        if self.capture is not None:  # a dx.compile capture holds the lock: another thread's instruction waits
            with self._lock:          # for its end (else it would be taken into the graph)
                self._append(instr, where)
            return
        self._append(instr, where)

    def _append(self, instr: Instr, where: Any) -> None:
        if self.collected:  # their deletions first: an in-place write (an optimizer's) then finds no views to copy
            with self._lock:
                self._drain_collected()
        # no lock: a session records from one thread at a time (collection never records: it only queues names;
        # a backward and a capture take the lock)
        pending = self.pending
        pending.append(instr)
        self.origins.append(where)
        if len(pending) >= self.max_pending:
            self.flush_full()

    def backward_seen(self, spec: dict[str, Any], remember: bool = False) -> bool:
        """Whether this backward request is recorded into the program (see LazyBackward.seen); `remember`: the daemon
        just derived it."""
        return self.lazy.seen(spec, remember)

    def undo_unrun(self, instr: Instr, undo: Any) -> None:
        """Call undo() if `instr` (about to be recorded) is in a program that fails before it runs: Python's own
        bookkeeping of it (an optimizer's step count) is then put back, as if it had never been recorded."""
        self._undo.append((instr, undo))

    def record_backward(self, instr: Instr, spec: dict[str, Any]) -> None:
        """Append `loss.backward()` as instruction `instr` (`backward (loss) -> (the gradients)`), which the
        daemon's scheduler expands in place into the backward program of `spec` (see Scheduler.on_run). The
        instruction and its entry in `backwards` go into the program together: the collected handles' deletions
        first, then room for it."""
        if self.collected:
            with self._lock:
                self._drain_collected()
        if len(self.pending) + 1 >= self.max_pending:
            self.flush_full()
        self.pending.append(instr)
        self.origins.append(origin(sys._getframe(1)))
        self.backwards.append({**spec, "index": len(self.pending) - 1})
        if len(self.pending) >= self.max_pending:
            self.flush_full()

    def flush_full(self) -> None:
        """Send the pending program because it reached max_pending; an error is kept for the next sync."""
        with self._lock:
            self._flush((), raise_now=False)

    def record_quiet(self, instr: Instr) -> None:
        """Append without looking for the user's line."""
        with self._lock:
            self.pending.append(instr)
            self.origins.append(None)

    def _drain_collected(self) -> None:
        """deltensor for each collected handle, except those whose tensor never came to exist."""
        collected, lost, pool = self.collected, self._lost, self.pool
        while collected:
            try:
                item = collected.popleft()
            except IndexError:
                break
            name, dtype, shape = item[0], item[1], item[2]
            if lost and name in lost:
                lost.discard(name)
                continue
            if shape is None and name.startswith(self._grad_root):
                self._grad_gone(name)
            elif shape is not None:
                pooled = len(item) == 3
                kept = pool if pooled else self._freed_now
                names = kept.get((shape, dtype))
                if names is None:
                    names = kept[(shape, dtype)] = []
                if len(names) < (self.pool_per_shape if pooled else self.freed_per_shape):
                    insort(names, name, key=_name_order)
                    if pooled:
                        continue  # kept, buffer and all, for the next result of its shape
                elif pooled:  # the pool is full: deleted, its name kept as a large result's (so that a model with
                    # more temporaries of one shape than the pool holds names them alike every step)
                    freed = self._freed_now.get((shape, dtype))
                    if freed is None:
                        freed = self._freed_now[(shape, dtype)] = []
                    if len(freed) < self.freed_per_shape:
                        insort(freed, name, key=_name_order)
            self.pending.append(_deletion(name, dtype))
            self.origins.append(None)

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
            self.transport.client.request("release_on_close", prefix=self._prefix if on else "")  # type: ignore
        except DeepxError as e:  # a deepxd from before this request: the session's own close still releases
            log.debug("release_on_close: %s", e)

    def _release_freed(self) -> None:
        """The names the program being sent deletes may be handed out from now on."""
        freed, cap = self.freed, self.freed_per_shape
        for key, names in self._freed_now.items():
            kept = freed.get(key)
            if kept is None:
                kept = freed[key] = []
            for name in names:
                if len(kept) < cap:
                    insort(kept, name, key=_name_order)
        self._freed_now = {}

    def grad_prefix(self) -> tuple[str, int]:
        """The name prefix of the next backward's gradients and temporaries: the first whose gradients are all gone."""
        k = 0
        live = self._grad_live
        while k in live:
            k += 1
        return f"{self._grad_root}{k}_", k

    def grad_prefix_taken(self, k: int, handles: int) -> None:
        if handles:
            self._grad_live[k] = handles

    def grad_prefix_failed(self, k: int) -> None:
        """A backward that failed may have left tensors of prefix k in the daemon: never hand k out again."""
        self._grad_live[k] = -1

    def _grad_gone(self, name: str) -> None:
        head = name[len(self._grad_root):].partition("_")[0]
        if head.isdigit():
            k = int(head)
            n = self._grad_live.get(k)
            if n is not None and n > 0:
                if n == 1:
                    del self._grad_live[k]
                else:
                    self._grad_live[k] = n - 1

    def empty_cache(self) -> None:
        """Delete the pooled temporaries (they are kept for reuse, at most pool_per_shape per shape and dtype)."""
        with self._lock:
            self._drain_collected()
            for (_, dtype), names in self.pool.items():
                for name in names:
                    self.pending.append(_deletion(name, dtype))
                    self.origins.append(None)
            self.pool.clear()
            self.freed.clear()  # deleted already
            self._freed_now.clear()

    def pooled_name(self, shape: Any, dtype: str) -> tuple[str, bool]:
        """A name for data sent from Python (dx.tensor): a pooled one of this shape and dtype (its tensor exists;
        the put replaces it), else a new one; and which. Never a deleted transpose's name: its deltensor may still
        be pending behind a failed program, and would delete the data."""
        with self._lock:
            if self.collected:
                self._drain_collected()
            names = self.pool.get((shape, dtype))
            if names:
                return names.pop(0), True
        return self.new_name(), False

    def reuse_name(self, shape: Any, dtype: str) -> str:
        """A name for a new result: a collected temporary's of the same shape and dtype when there is one."""
        collected = self.collected
        if collected:
            # the common case, lock-free: one collected temporary that goes to the pool
            if len(collected) == 1 and not self._lost:
                try:
                    item = collected.popleft()
                except IndexError:
                    pass
                else:
                    name, dt, shp = item[0], item[1], item[2]
                    if len(item) != 3:  # its name is to be deleted as well: _drain_collected
                        collected.appendleft(item)
                    elif dt == dtype and shp == shape:  # what the pool would hand straight back
                        self._reused.add(name)
                        self._taken[name] = len(self.pending)
                        return name
                    else:
                        names = self.pool.get((shp, dt)) if shp is not None else None
                        if names is not None and len(names) < self.pool_per_shape:
                            insort(names, name, key=_name_order)
                        else:
                            collected.appendleft(item)
            if collected:
                with self._lock:
                    self._drain_collected()
        # the lowest-numbered free name: which one a result takes depends on which names are free, not on the order
        # Python collected them, so that a loop's steps name their temporaries alike (and send the same programs)
        names = self.pool.get((shape, dtype))
        if names:
            name = names.pop(0)
            self._reused.add(name)
            self._taken[name] = len(self.pending)
            return name
        return self._freed_or_new(shape, dtype)

    def freed_name(self, shape: Any, dtype: str) -> str:
        """A name for a tensor made with newtensor: a deleted one of this shape and dtype where there is one (its
        tensor exists again once the pending program has run), else a new one."""
        if self.collected:
            with self._lock:
                self._drain_collected()
        return self._freed_or_new(shape, dtype)

    def _freed_or_new(self, shape: Any, dtype: str) -> str:
        names = self.freed.get((shape, dtype))
        if names:
            name = names.pop(0)
            self._revived.add(name)  # its tensor exists again once this program has run
        else:
            name = f"{self._prefix}{next(self._names)}"
        self._taken[name] = len(self.pending)
        return name

    def sync(self, fetch: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """Send what is pending (with `fetch` read back); raise the first error since the last sync."""
        if fetch and self.capture is not None:
            raise self.capture.refuse_read(fetch)
        if fetch and self._lost:
            self._refuse_lost(fetch)
        with self._lock:
            try:
                out = self._flush(fetch, raise_now=True)
            except DeepxError:
                if self.error is None:
                    raise
                # an earlier flush (past max_pending) failed first: that is the cause; this one followed from it
                err, self.error = self.error, None
                raise err from None
            if self.error is not None:
                err, self.error = self.error, None
                raise err
            return out

    def _refuse_lost(self, fetch: Sequence[str]) -> None:
        """Reading a tensor that a failed program never made: the failure's error where it is still to be raised,
        else an error that says so (rather than the daemon's 'not found', or an older value under a reused name)."""
        gone = [name for name in fetch if name in self._lost]
        if not gone:
            return
        with self._lock:
            if self.error is not None:
                err, self.error = self.error, None
                raise err
        cause = f": {self._failure}" if self._failure else ""
        raise DeepxError(f"tensor '{gone[0]}' has no value: the program that was to compute it failed{cause}")

    def _flush(self, fetch: Sequence[str], raise_now: bool) -> dict[str, np.ndarray]:
        if self.closed:
            raise DeepxError("this deepx session is closed; call dx.connect() again")
        if self.collected:
            self._drain_collected()
        if self.graph_drops:
            self._drop_graphs()
        if not self.pending and not fetch:
            return {}
        program, origins, backwards, revived = self.pending, self.origins, self.backwards, self._revived
        reused, taken, undo = self._reused, self._taken, self._undo
        self.pending, self.origins, self.backwards, self._revived, self._reused = [], [], [], set(), set()
        self._taken, self._undo = {}, []
        if self._freed_now:
            self._release_freed()
        self.runs += 1
        mark, self._mark = self._mark, next(self._names)
        if fetch and not self.transport.can_read:
            self.transport.run(program, ())
            raise DeepxError(f"cannot read tensor values over {getattr(self.transport, 'address', '?')}: deepxIR over "
                             "UDP has no way back for data; connect to a deepxd over unix:// (or embedded) to read "
                             "values")
        if backwards:
            self.lazy.judge(program, backwards)
        try:
            outcome = (self.transport.run(program, fetch, backwards) if backwards  # type: ignore[call-arg]
                       else self.transport.run(program, fetch))
        except DeepxError as e:
            if str(e).startswith("lost the connection"):  # said once (the client names the address)
                raise
            raise DeepxError(f"lost the connection to deepxd: {e}") from None
        for line in outcome.output:
            sys.stdout.write(line + "\n")
        if outcome.ok:
            if self._stale:
                self._stale.clear()  # their deletions were in this program
        else:
            self._forget_unrun(program, outcome.done, mark, revived, reused, taken)
            if undo:
                unrun = {id(i) for i in program[outcome.done:]}
                for instr, fn in undo:
                    if id(instr) in unrun:
                        fn()
            err = self._error(outcome, program, origins)
            self._failure = str(err)
            if raise_now:
                raise err
            if self.error is None:
                self.error = err
        return outcome.tensors

    def _drop_graphs(self) -> None:
        """The graphs of collected compiled functions: their plans and kept temporaries let go (the stored records
        stay in the plane, replayable by name). A failure is logged, never raised: it is housekeeping."""
        from deepx_sdk.compile import _link

        while self.graph_drops:
            name = self.graph_drops.popleft()
            self.graphs_made.discard(name)
            try:
                _link(self.transport).drop(name)
            except DeepxError as e:
                log.debug("dropping graph %s: %s", name, e)

    def _forget_unrun(self, program: list[Instr], done: int, mark: int, revived: Collection[str] = frozenset(),
                      reused: Collection[str] = frozenset(), taken: Mapping[str, int] | None = None) -> None:
        """Instructions from `done` on did not run: the tensors they would have made do not exist (Python must not
        delete them when it collects their handles), and the deletions among them did not happen (sent again).

        A result's name handed out in this program (`taken`: where its instruction stands) whose instruction did not
        run has no value: counted as never made, so that reading it raises. Where an older value may stand under
        that name (a pooled temporary's, `reused`, or one an instruction that ran wrote before the name was handed
        out again) the next program deletes it (a newtensor first, which keeps what stands there and makes a tensor
        where nothing does, so that the delete finds one either way). A result made before `done` and written in
        place after it keeps its value. Names handed out otherwise are counted as never made where they are new
        since `mark`, or `revived` (a deleted name handed out again), and nothing that ran wrote them."""
        made = {p.value for instr in program[:done] if instr.name != "deltensor"
                for p in instr.returns if p.category == "tensor"}
        taken = taken or {}
        prefix, n = self._prefix, len(self._prefix)
        unrun_deletes = []
        stale: dict[str, Any] = {}
        for instr in program[done:]:
            if instr.name == "deltensor":
                unrun_deletes.append(instr)
                continue
            if instr.name == "backward":  # its gradients never came to exist, and its prefix is not handed out again
                names = [str(p.value) for p in instr.returns]
                self._lost.update(names)
                head = names[0][len(self._grad_root):].partition("_")[0] if names else ""
                if head.isdigit():
                    self.grad_prefix_failed(int(head))
                continue
            for p in instr.returns:
                name = p.value
                if p.category != "tensor" or not isinstance(name, str):
                    continue
                at = taken.get(name)
                if at is not None:
                    if at < done:
                        continue  # its value was made; a later write in place did not run
                    if name in reused or name in made:
                        stale.setdefault(name, p.precisions[0])
                    else:
                        self._lost.add(name)
                elif name not in made and (name in revived or (name.startswith(prefix) and name[n:].isdigit()
                                                               and int(name[n:]) > mark)):
                    self._lost.add(name)
        if self._stale:
            self._stale.difference_update(i.returns[0].value for i in program[:done] if i.name == "deltensor")
        for name, dtype in stale.items():  # deleted first, so that no older value stays under a result's name
            self._queue_stale(name, dtype)
            self._lost.add(name)
            self._stale.add(name)
        for instr in unrun_deletes:
            name = instr.returns[0].value
            if name in self._stale:
                if name in stale:  # made and dropped in this program: no handle left, its deletion queued above
                    self._lost.discard(name)
                else:  # an older value's deletion, queued by an earlier failure: still to be done
                    self._queue_stale(name, instr.returns[0].precisions[0])
            elif name in self._lost:
                self._lost.discard(name)
            else:
                self.pending.append(instr)
                self.origins.append(None)
        if self._lost:
            # a temporary collected while its program was pending was pooled as the flush began (a pooled name has no
            # handle left): it never came to exist, so it is neither pooled nor waited for
            for names in self.pool.values():
                for name in [m for m in names if m in self._lost]:
                    names.remove(name)
                    self._lost.discard(name)

    def _queue_stale(self, name: str, dtype: Any) -> None:
        """Delete whatever stands under `name`, if anything: newtensor keeps a tensor that exists (and makes one where
        none does), so the deltensor after it always finds one."""
        self.pending.append(Instr("newtensor", (Param.vector(()),), (Param("tensor", (dtype,), name),),
                                  (("exists", "keep"),)))
        self.origins.append(None)
        self.pending.append(_deletion(name, dtype))
        self.origins.append(None)

    def _error(self, outcome: Outcome, program: list[Instr], origins: list[Any]) -> DeepxError:
        i = outcome.error_index
        where = ""
        made_at = origin_of(origins[i]) if 0 <= i < len(origins) else None
        if made_at is not None:
            code, offset = made_at
            where = f" (from {code.co_filename}:{source_line(code, offset)}, in {code.co_name})"
        msg = outcome.error or "the program failed"
        if self._lost and 0 <= i < len(program):
            # it read a tensor that an earlier failed program never made: say so, with that failure
            never = [p.value for p in program[i].args if p.category == "tensor" and p.value in self._lost]
            if never:
                cause = f" ({self._failure})" if self._failure else ""
                msg += f"; '{never[0]}' was never computed: an earlier program failed{cause}"
        return DeepxError(f"{msg}{where}")

    def put(self, name: str, array: np.ndarray, heap: bool = False) -> None:
        with self._lock:
            self._flush((), raise_now=False)
            self.transport.put(name, array, heap)
            # the tensor exists now: every name numbered so far was made or is known lost, as after a flush (so a
            # later failed program that writes it in place does not count it among the tensors never made)
            self._mark = next(self._names)

    def close(self) -> None:
        if self.closed:
            return
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker, a Pool) at its exit: the parent's session
            self.closed = True
            return
        try:
            with self._lock:
                if self.pending:
                    self._flush((), raise_now=False)
                if self.release_on_close and isinstance(self.transport, NativeTransport):
                    self._release_all()
        except DeepxError as e:
            log.debug("closing: %s", e)
        self.closed = True
        self.transport.close()

    def _release_all(self) -> None:
        """On a running deepxd (unix://), what this session made goes with it: every tensor under its names (its
        results, parameters and optimizer state: heap tensors other processes hold stay until they release them)
        and the plans and kept temporaries of its compiled functions' graphs (the records stay in the plane). An
        embedded daemon goes with the process anyway."""
        self.graph_drops.extend(sorted(self.graphs_made))
        self._drop_graphs()
        client = self.transport.client  # type: ignore[attr-defined]
        rows = client.admin("tensors")
        mine = [(r["name"], r["dtype"]) for r in rows if str(r.get("name", "")).startswith(self._prefix)]
        if mine:
            r = client.run([_deletion(n, d) for n, d in mine])
            if not r.ok:
                log.debug("closing: deleting this session's tensors: %s", r.error)


_current: Session | None = None
_current_lock = threading.Lock()


def connect(address: str | None = None, *, max_pending: int = 4096, roles: Sequence[str] | None = None,
            release: bool = True) -> Session:
    """Connect to deepx: `address` None (and no DEEPX_ADDRESS) starts an embedded daemon in this process (with
    `roles`, else DEEPX_ROLES, else the CPU roles: `roles=["op-cuda"]` runs it on the GPU); `unix:///path` reaches a
    running deepxd; `udp://host:port` speaks deepxIR text to any deepx executor. `release`: on a running deepxd,
    closing the session (or the interpreter's exit) deletes the tensors it made and lets go of its compiled graphs'
    plans; False leaves them there (for `deepxctl tensors ls` after the script)."""
    global _current
    with _current_lock:
        if _current is not None:
            _current.close()
        _current = Session(open_transport(address, roles), max_pending=max_pending)
        _current.release_on_close = release
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
