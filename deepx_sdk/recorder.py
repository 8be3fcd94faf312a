"""The recorder: a session's pending program, and how it is sent.

Tensor operations append instructions to the pending program, each with the line of user code that made it; the
program is sent through the transport as one frame when a value is read, at `dx.sync()`, or when it grows past
`max_pending`. Handles Python collects are queued (lock-free: collection runs in any thread) and become deletions,
or pooled names, before the next instruction. A program that fails part-way is repaired: what did not run is
forgotten (NamePool.forget_unrun) or sent again, and the error is raised at the next read naming the user's line.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
from bisect import insort
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import CodeType
from typing import Any

import numpy as np

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, Param
from deepx_sdk.labels import Labels
from deepx_sdk.names import HandOut, NamePool, name_order
from deepx_sdk.transports import Outcome, Transport

log = logging.getLogger(__name__)

_SDK_DIR = os.path.dirname(os.path.abspath(__file__))
# id(code object) -> (the code object, whether it is the SDK's own): recording walks past the SDK's frames to the
# user's line. By id, because hashing a code object hashes its contents; the entry holds the code object, so its
# id is never reused while the entry stands (notebook cells make new code objects: the memo is bounded)
_IN_SDK: Cache[int, tuple[CodeType, bool]] = Cache("sdk.in_sdk", 65536, counted=False)


def in_sdk(code: CodeType) -> tuple[CodeType, bool]:
    """(code, whether it is the SDK's own), remembered in _IN_SDK."""
    return _IN_SDK.put(id(code), (code, code.co_filename.startswith(_SDK_DIR)))


def origin(f: Any) -> Any:
    """The entry of Recorder.origins for frame `f`: the first frame from it outwards that is not the SDK's, as
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


def maker(f: Any) -> Any:
    """origin(), past the standard library's frames as well (copy.deepcopy's, functools'): the user's line that made
    a tensor, its CALL SITE. Only where a tensor is made, not per op."""
    while f is not None:
        entry = origin(f)
        made_at = origin_of(entry)
        if made_at is None or not _in_stdlib(made_at[0]):
            return entry
        while f is not None and f.f_code is not made_at[0]:  # on from the standard library's frame
            f = f.f_back
        f = f.f_back if f is not None else None
    return None


def _in_stdlib(code: CodeType) -> bool:
    name = code.co_filename
    return name.startswith(_STDLIB) and "-packages" not in name[len(_STDLIB):]


_STDLIB = os.path.dirname(os.__file__) + os.sep  # the standard library (site- and dist-packages below it are not)


def origin_of(entry: Any) -> tuple[CodeType, int] | None:
    """(code, offset) of an entry of Recorder.origins: a tuple, or id(code) << 24 | offset (the code object then
    found in _IN_SDK, which holds it); None where unknown."""
    if type(entry) is int:
        known = _IN_SDK.get(entry >> 24)
        return (known[0], entry & 0xFFFFFF) if known is not None else None
    return entry


def call_site(entry: Any) -> str | None:
    """`file:line` of an entry of Recorder.origins (a tensor's CALL SITE in deepxctl); None where unknown."""
    made_at = origin_of(entry)
    if made_at is None:
        return None
    code, offset = made_at
    key = (id(code), offset)
    known = _SITES.get(key)
    if known is not None and known[0] is code:
        return known[1]  # type: ignore[no-any-return]
    site = f"{code.co_filename}:{source_line(code, offset)}"
    _SITES.put(key, (code, site))
    return site


# (id(code), offset) -> (the code object, its `file:line`): working a line out walks the code's line table
_SITES: Cache[tuple[int, int], tuple[CodeType, str]] = Cache("sdk.call_sites", 4096, counted=False)


def source_line(code: CodeType, offset: int) -> int | None:
    """The line of `code` whose bytecode holds byte `offset` (a frame's f_lasti)."""
    line = None
    for start, end, n in code.co_lines():
        if start <= offset < end:
            return n
        if start <= offset and n is not None:
            line = n
    return line if line is not None else code.co_firstlineno


#: deltensor instructions by (name, dtype): a loop deletes the same names every step, and the same objects then
#: cost nothing to make and compare at identity speed (same_program)
_DELETIONS: Cache[tuple[str, Any], Instr] = Cache("sdk.deletions", 16384, counted=False)


def _deletion(name: str, dtype: Any) -> Instr:
    key = (name, dtype)
    instr = _DELETIONS.get(key)
    if instr is None:
        instr = _DELETIONS.put(key, Instr("deltensor", (), (Param("tensor", (dtype,), name),)))
    return instr


class Recorder:
    """The pending program of one session, its names' hand-outs (through `names`) and its sending (through
    `transport`). `pending`, `origins` and `collected` are never replaced, only emptied: the session hands them to
    the recording hot path as they are (tensor._emit)."""

    def __init__(self, transport: Transport, names: NamePool, lock: threading.RLock,
                 max_pending: int = 4096, labels: Labels | None = None) -> None:
        self.transport = transport
        self.names = names
        self.labels = labels if labels is not None else Labels(call_site)  # sent after the program that made them
        self.lock = lock  # the session's: one flush, backward or capture at a time
        self.max_pending = max_pending
        self.pending: list[Instr] = []
        self.origins: list[tuple[CodeType, int] | int | None] = []  # per instruction, see origin_of
        # backward instructions in `pending` (record_backward): what the daemon expands each into, with its index
        self.backwards: list[dict[str, Any]] = []
        # (instruction, undo) pairs of the pending program: where the instruction does not run, undo() puts back
        # what Python counted when it was recorded (an optimizer's step count: see undo_unrun)
        self._undo: list[tuple[Instr, Any]] = []
        # (name, dtype, shape or None[, True]) of handles Python collected: appended without a lock (garbage
        # collection runs in any thread, the embedded daemon's too, while another holds the lock), and turned into
        # deletions or pooled names before the next instruction (NamePool.release)
        self.collected: collections.deque[tuple[Any, ...]] = collections.deque()
        # stored graphs of compiled functions Python collected, appended the same way: the next flush has the daemon
        # let go of their plans and kept temporaries (compile._drop_when_gone)
        self.graph_drops: collections.deque[str] = collections.deque()
        self.graphs_made: set[str] = set()  # graphs this session stored or took from the plane (see release_all)
        self.error: DeepxError | None = None  # a failure of a flush past max_pending, raised at the next sync
        self._failure = ""  # the last failed program's error, for a later read of a tensor it never made
        # set while dx.compile captures a call (deepx_sdk/compile.py): reading a value then is refused
        self.capture: Any = None
        # programs, backward requests and graph replays sent so far: a value read back along with one of them
        # (Tensor._v, a replay's small outputs) is the tensor's value for as long as no other has been sent
        self.runs = 0
        # the last program run and where its instructions ran (its reply's placement; None: all on the daemon's
        # worker): what dx.explain() with no graph shows
        self.last_run: tuple[list[Instr], dict[str, Any] | None] | None = None
        self.closed = False

    # -- recording
    def record(self, instr: Instr) -> None:
        """Append an instruction; remember which line of user code made it (its code object and the offset of the
        call in it: the line number is worked out only when an error names it)."""
        self.record_at(instr, origin(sys._getframe(1)))

    def record_at(self, instr: Instr, where: Any) -> None:
        """record(), with the user's line already found (`where`: an origin() entry, None where unknown): an
        optimizer's step looks it up once for all its updates."""
        if self.capture is not None:  # a dx.compile capture holds the lock: another thread's instruction waits
            with self.lock:           # for its end (else it would be taken into the graph)
                self._append(instr, where)
            return
        self._append(instr, where)

    def _append(self, instr: Instr, where: Any) -> None:
        if self.collected:  # their deletions first: an in-place write (an optimizer's) then finds no views to copy
            with self.lock:
                self._drain()
        # no lock: a session records from one thread at a time (collection never records: it only queues names;
        # a backward and a capture take the lock)
        pending = self.pending
        pending.append(instr)
        self.origins.append(where)
        if len(pending) >= self.max_pending:
            self.flush_full()

    def record_quiet(self, instr: Instr) -> None:
        """Append without looking for the user's line."""
        with self.lock:
            self.pending.append(instr)
            self.origins.append(None)

    def record_backward(self, instr: Instr, spec: dict[str, Any]) -> None:
        """Append `loss.backward()` as instruction `instr` (`backward (loss) -> (the gradients)`), which the
        daemon's scheduler expands in place into the backward program of `spec` (see Scheduler.on_run). The
        instruction and its entry in `backwards` go into the program together: the collected handles' deletions
        first, then room for it."""
        if self.collected:
            with self.lock:
                self._drain()
        if len(self.pending) + 1 >= self.max_pending:
            self.flush_full()
        self.pending.append(instr)
        self.origins.append(origin(sys._getframe(1)))
        self.backwards.append({**spec, "index": len(self.pending) - 1})
        if len(self.pending) >= self.max_pending:
            self.flush_full()

    def undo_unrun(self, instr: Instr, undo: Any) -> None:
        """Call undo() if `instr` (about to be recorded) is in a program that fails before it runs: Python's own
        bookkeeping of it (an optimizer's step count) is then put back, as if it had never been recorded."""
        self._undo.append((instr, undo))

    def _drain(self) -> None:
        """deltensor for each collected handle whose name is not kept with its tensor (NamePool.release)."""
        dead = self.names.release(self.collected)
        if dead:
            pending, origins = self.pending, self.origins
            for item in dead:
                pending.append(_deletion(item[0], item[1]))
                origins.append(None)

    # -- names for results
    def reuse_name(self, shape: Any, dtype: str) -> str:
        """A name for a new result: a collected temporary's of the same shape and dtype when there is one."""
        collected, names = self.collected, self.names
        if collected:
            # the common case, lock-free: one collected temporary that goes to the pool
            if len(collected) == 1 and not names.lost:
                try:
                    item = collected.popleft()
                except IndexError:
                    pass
                else:
                    name, dt, shp = item[0], item[1], item[2]
                    if len(item) != 3:  # its name is to be deleted as well: NamePool.release
                        collected.appendleft(item)
                    elif dt == dtype and shp == shape:  # what the pool would hand straight back
                        names.reused.add(name)
                        names.taken[name] = len(self.pending)
                        return name
                    else:
                        kept = names.pool.get((shp, dt)) if shp is not None else None
                        if kept is not None and len(kept) < names.pool_per_shape:
                            insort(kept, name, key=name_order)
                        else:
                            collected.appendleft(item)
            if collected:
                with self.lock:
                    self._drain()
        # the lowest-numbered free name: which one a result takes depends on which names are free, not on the order
        # Python collected them, so that a loop's steps name their temporaries alike (and send the same programs)
        kept = names.pool.get((shape, dtype))
        if kept:
            name = kept.pop(0)
            names.reused.add(name)
            names.taken[name] = len(self.pending)
            return name
        return names.take_freed(shape, dtype, len(self.pending))

    def deleted_name(self, shape: Any, dtype: str) -> str:
        """A name for a result deleted once collected (a transpose): a deleted one of this shape and dtype first,
        then a pooled one, then a new one. Pooled first, a Linear's transposed weight would take the name its ReLU's
        output had in the step before, the ReLU then the transpose's, and the steps alternate between two programs
        (two plans in the daemon, each run on a state the other left)."""
        if self.collected:
            with self.lock:
                self._drain()
        names = self.names
        if names.freed.get((shape, dtype)):
            return names.take_freed(shape, dtype, len(self.pending))
        return self.reuse_name(shape, dtype)

    def freed_name(self, shape: Any, dtype: str) -> str:
        """A name for a tensor made with newtensor: a deleted one of this shape and dtype where there is one (its
        tensor exists again once the pending program has run), else a new one."""
        if self.collected:
            with self.lock:
                self._drain()
        return self.names.take_freed(shape, dtype, len(self.pending))

    def pooled_name(self, shape: Any, dtype: str) -> tuple[str, bool]:
        """A name for data sent from Python (dx.tensor): a pooled one of this shape and dtype (its tensor exists;
        the put replaces it), else a new one; and which. Never a deleted transpose's name: its deltensor may still
        be pending behind a failed program, and would delete the data."""
        with self.lock:
            if self.collected:
                self._drain()
            name = self.names.take_pooled(shape, dtype)
        if name is not None:
            return name, True
        return self.names.new_name(), False

    def empty_cache(self) -> None:
        """Delete the pooled temporaries (they are kept for reuse, at most pool_per_shape per shape and dtype)."""
        with self.lock:
            self._drain()
            for name, dtype in self.names.clear_pool():
                self.pending.append(_deletion(name, dtype))
                self.origins.append(None)

    # -- sending
    def flush_full(self) -> None:
        """Send the pending program because it reached max_pending; an error is kept for the next sync."""
        with self.lock:
            self._flush((), raise_now=False)

    def sync(self, fetch: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """Send what is pending (with `fetch` read back); raise the first error since the last sync. Another thread's
        read waits here while a dx.compile capture holds the lock; the capturing thread's own is refused."""
        with self.lock:
            if fetch and self.capture is not None:
                raise self.capture.refuse_read(fetch)
            if fetch and self.names.lost:
                self._refuse_lost(fetch)
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

    def put(self, name: str, array: np.ndarray, heap: bool = False, made: bool = True) -> None:
        """Send a tensor's data (after what is pending). `made`: it makes the tensor (its call site is the user's
        line that called the SDK), rather than loading values into one (load_state_dict)."""
        with self.lock:
            self._flush((), raise_now=False)
            self.transport.put(name, array, heap)
            # the tensor exists now: every name numbered so far was made or is known lost, as after a flush (so a
            # later failed program that writes it in place does not count it among the tensors never made)
            self.names.all_made()
            if made:
                self.labels.made_at(name, maker(sys._getframe(1)))
            if self.capture is None and self.labels.due():
                self.send_labels()

    def made_here(self, name: str) -> None:
        """Tensor `name` is made by the instruction about to be recorded: its call site is the user's line that
        called the SDK (sent with the labels after the next program)."""
        self.labels.made_at(name, maker(sys._getframe(1)))

    def send_labels(self) -> None:
        """Tell the daemon the labels not sent yet (deepx_sdk/labels.py), now; a daemon from before labels is not
        asked again. Never raises: labels are for operators, not for the program."""
        labels = self.labels
        tensors = labels.take()
        if not labels.enabled or not tensors:
            return
        labels.requests += 1
        try:
            self.transport.label(None, tensors)
        except DeepxError as e:
            labels.enabled = False
            log.debug("labels not sent (%s); no more are", e)

    def sent_request(self) -> None:
        """A request went to the transport outside the program (a backward, a graph replay): values read back
        before it are no longer known to be current (see runs)."""
        self.runs += 1

    def drop_graph(self, name: str) -> None:
        """Have the daemon let go of stored graph `name`'s plans with the next program (lock-free: a finalizer's)."""
        self.graph_drops.append(name)

    def graph_made(self, name: str) -> None:
        """This session stored graph `name` or took it from the plane: closing it lets go of the graph's plans."""
        self.graphs_made.add(name)

    @contextmanager
    def capturing(self, stand_in: Any) -> Iterator[None]:
        """Programs go to `stand_in` (a transport that also keeps them: dx.compile's capture) while inside; reading a
        value is refused (stand_in.refuse_read)."""
        inner, self.transport, self.capture = self.transport, stand_in, stand_in
        try:
            yield
        finally:
            self.transport, self.capture = inner, None

    def _refuse_lost(self, fetch: Sequence[str]) -> None:
        """Reading a tensor that a failed program never made: the failure's error where it is still to be raised,
        else an error that says so (rather than the daemon's 'not found', or an older value under a reused name)."""
        gone = [name for name in fetch if name in self.names.lost]
        if not gone:
            return
        with self.lock:
            if self.error is not None:
                err, self.error = self.error, None
                raise err
        cause = f": {self._failure}" if self._failure else ""
        raise DeepxError(f"tensor '{gone[0]}' has no value: the program that was to compute it failed{cause}")

    def _flush(self, fetch: Sequence[str], raise_now: bool) -> dict[str, np.ndarray]:
        if self.closed:
            raise DeepxError("this deepx session is closed; call dx.connect() again")
        if self.collected:
            self._drain()
        if self.graph_drops:
            self._drop_graphs()
        pending, origins = self.pending, self.origins
        if not pending and not fetch:
            return {}
        # the lists stay (the hot path holds them); what is sent is a copy of the first n, and only those go: another
        # thread may append meanwhile (recording takes no lock), and what it appends goes with the next program
        n = len(pending)
        program, where, backwards, undo = pending[:n], origins[:n], self.backwards, self._undo
        del pending[:n]
        del origins[:n]
        self.backwards, self._undo = [], []
        handout = self.names.sent()
        self.runs += 1
        if fetch and not self.transport.can_read:
            self.transport.run(program, ())
            raise DeepxError(f"cannot read tensor values over {getattr(self.transport, 'address', '?')}: deepxIR over "
                             "UDP has no way back for data; connect to a deepxd over unix:// or tcp:// (or embedded) "
                             "to read values")
        try:
            outcome = (self.transport.run(program, fetch, backwards) if backwards  # type: ignore[call-arg]
                       else self.transport.run(program, fetch))
        except DeepxError as e:
            if str(e).startswith("lost the connection"):  # said once (the client names the address)
                raise
            raise DeepxError(f"lost the connection to deepxd: {e}") from None
        for line in outcome.output:
            sys.stdout.write(line + "\n")
        self.last_run = (program, outcome.placement)
        labels = self.labels
        if labels.all_sites and handout.taken:  # DEEPX_CALLSITES=1: every result's line
            labels.made(handout.taken, where)
        if labels.pending and self.capture is None and labels.due():
            self.send_labels()
        if outcome.ok:
            self.names.ran()
        else:
            self._forget_unrun(program, outcome.done, handout)
            if undo:
                unrun = {id(i) for i in program[outcome.done:]}
                for instr, fn in undo:
                    if id(instr) in unrun:
                        fn()
            err = self._error(outcome, program, where)
            self._failure = str(err)
            if raise_now:
                raise err
            if self.error is None:
                self.error = err
        return outcome.tensors

    def _forget_unrun(self, program: list[Instr], done: int, handout: HandOut) -> None:
        """Instructions from `done` on did not run: the names decide what that leaves (NamePool.forget_unrun), and
        the next program deletes what must go (older values under reused names, deletions that did not run)."""
        pending, origins = self.pending, self.origins
        for name, dtype, instr in self.names.forget_unrun(program, done, handout):
            if instr is None:  # newtensor keeps a tensor that exists (and makes one where none does), so the
                # deltensor after it always finds one
                pending.append(Instr("newtensor", (Param.vector(()),), (Param("tensor", (dtype,), name),),
                                     (("exists", "keep"),)))
                origins.append(None)
                instr = _deletion(name, dtype)
            pending.append(instr)
            origins.append(None)

    def _error(self, outcome: Outcome, program: list[Instr], origins: list[Any]) -> DeepxError:
        i = outcome.error_index
        where = ""
        made_at = origin_of(origins[i]) if 0 <= i < len(origins) else None
        if made_at is not None:
            code, offset = made_at
            where = f" (from {code.co_filename}:{source_line(code, offset)}, in {code.co_name})"
        msg = outcome.error or "the program failed"
        lost = self.names.lost
        if lost and 0 <= i < len(program):
            # it read a tensor that an earlier failed program never made: say so, with that failure
            never = [p.value for p in program[i].args if p.category == "tensor" and p.value in lost]
            if never:
                cause = f" ({self._failure})" if self._failure else ""
                msg += f"; '{never[0]}' was never computed: an earlier program failed{cause}"
        return DeepxError(f"{msg}{where}")

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

    # -- closing
    def close(self, release: bool) -> None:
        """Send what is pending and close the transport; `release`: first delete what the session made on a running
        deepxd (release_all)."""
        if self.closed:
            return
        try:
            with self.lock:
                if self.pending:
                    self._flush((), raise_now=False)
                if release:
                    self.release_all()
        except DeepxError as e:
            log.debug("closing: %s", e)
        self.closed = True
        self.transport.close()

    def abandon(self) -> None:
        """Closed without sending or closing anything: a forked child's inherited session is its parent's."""
        self.closed = True

    def release_all(self) -> None:
        """On a running deepxd (unix://, tcp://), what this session made goes with it: every tensor under its names (its
        results, parameters and optimizer state: heap tensors other processes hold stay until they release them)
        and the plans and kept temporaries of its compiled functions' graphs (the records stay in the plane). An
        embedded daemon goes with the process anyway."""
        self.graph_drops.extend(sorted(self.graphs_made))
        self._drop_graphs()
        client = self.transport.client  # type: ignore[attr-defined]
        prefix = self.names.prefix
        rows = client.admin("tensors", prefix=prefix)
        mine = [(r["name"], r["dtype"]) for r in rows if str(r.get("name", "")).startswith(prefix)]
        if mine:
            r = client.run([_deletion(n, d) for n, d in mine])
            if not r.ok:
                log.debug("closing: deleting this session's tensors: %s", r.error)
