"""An event loop in a background thread that the calling thread may borrow (the embedded daemon's loop).

The embedded deepxd's actors live on an asyncio loop in a thread of their own, so that they serve deepxctl and
other clients while the notebook is idle. Handing each program to that thread and the answer back costs two thread
wake-ups (about 0.1-0.2 ms each on a small VM), more than the scheduler and the op worker spend on a known program.

`LoopThread.call` avoids both where it can. The loop's thread holds a lock, its *turn*, whenever it runs loop code,
and lets go of it only while it sleeps in the selector, waiting for I/O or a timer. A caller that gets the turn
(without waiting for it) knows the loop's thread is asleep and will stay so until the turn is given back, so it
runs the coroutine itself, on its own thread, with that loop set as the running loop:

- the coroutine becomes a task of the loop, as it would on the loop's thread, and its first step runs here (so
  `current_task`, `asyncio.timeout` and context variables behave as in any task);
- a coroutine that never waits (the actors answer an ask directly when they are idle) finishes in that step, with
  no thread hand-off at all;
- one that does wait (an actor busy with another message, a socket, a worker thread) goes on as the loop's task on
  the loop's thread; the caller waits for its answer as before;
- the loop's thread is woken afterwards if the step left it callbacks or timers, and the next call goes to it
  (rather than borrowing) until it has done them, so that work left behind is not held up by a busy caller.

Where the turn is taken (the loop's thread is busy, or in asyncio's debug mode, which checks threads), the
coroutine goes to the loop's thread as `asyncio.run_coroutine_threadsafe` sends it.

`LoopThread.now` borrows the loop the same way for a plain function: no task, no coroutine, nothing of asyncio's on
the way. The embedded daemon's training steps go so (`Scheduler.now_run`: a step the scheduler has run before, its
actors idle), which saves the task and the chain of asks that `call` would make of them; where the function finds it
needs to wait after all, it returns a coroutine, which goes on as in `call`, under the same turn. Where the loop
cannot be borrowed, it runs nothing and says so (`NOT_NOW`), and the caller takes `call`.

Ctrl-C: on the main thread, a borrowed run is not interrupted half-way by the first Ctrl-C (the actors' state would
be left half changed); the SIGINT handler in place (Python's KeyboardInterrupt, or the program's own, a checkpoint
on Ctrl-C say) is called when the run has finished. A second Ctrl-C calls it at once. An ignored SIGINT (a job
started with `&`) stays ignored. Outside a borrowed run SIGINT is left to whatever handles it. So whether the loop is
borrowed never depends on SIGINT's disposition.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import selectors
import signal
import sys
import threading
from _signal import getsignal as _getsignal  # signal.getsignal and .signal without their enum conversion (20x)
from _signal import signal as _setsignal
from asyncio import events
from collections.abc import Callable, Coroutine
from types import CoroutineType
from typing import Any

log = logging.getLogger(__name__)

#: how long `call` waits for the loop's thread to go to sleep before it sends the coroutine there instead
TURN_WAIT_S = 0.002
#: what `LoopThread.now` answers where it ran nothing
NOT_NOW = object()


class _TurnSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The platform's selector, which gives up the loop thread's turn while it waits (and only then)."""

    def __init__(self, turn: threading.Lock) -> None:
        super().__init__()
        self._turn = turn
        self.sleeps = 0  # waits that gave up the turn: the loop's thread has done its ready callbacks each time

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:  # a poll: callbacks are ready, the thread goes on at once
            return super().select(timeout)
        self.sleeps += 1
        self._turn.release()
        try:
            found = super().select(timeout)
        finally:
            self._turn.acquire()
        # a borrowed run may have changed the registrations since the wait began: what stands now counts
        keys = self.get_map()
        fresh = []
        for key, events_ in found:
            now = keys.get(key.fd)
            if now is not None and events_ & now.events:
                fresh.append((now, events_ & now.events))
        return fresh


def _noop() -> None:
    pass


def _settle(cf: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
    """Pass a finished task's outcome to the concurrent future its caller waits on."""
    if task.cancelled():
        cf.cancel()
    elif task.exception() is not None:
        cf.set_exception(task.exception())
    else:
        cf.set_result(task.result())


# SIGINT on the main thread while it runs a borrowed coroutine: the first is held until the run has finished, then
# handed to the handler that was in place (_outer)
_SIGINT = int(signal.SIGINT)
_MAIN = threading.main_thread().ident
_held = 0
_caught = False
_outer: Any = None


def _on_sigint(signum: int, frame: Any) -> None:
    global _caught
    if _held and not _caught:
        _caught = True
        return
    _caught = False  # a second one: at once
    _outer(signum, frame)


class LoopThread:
    """An asyncio loop run forever by a daemon thread named `name`, which `call` may borrow (see the module)."""

    def __init__(self, name: str) -> None:
        self.turn = threading.Lock()
        self.selector = _TurnSelector(self.turn)
        self.loop = asyncio.SelectorEventLoop(self.selector)
        self.name = name
        self.borrowed = 0  # calls run on the caller's thread to the end
        self.resumed = 0  # calls whose first step ran on the caller's thread, finished by the loop's thread
        self.sent = 0  # calls sent to the loop's thread from the start
        self.woken = 0  # borrowed calls that left the loop's thread something to do
        self.thread: threading.Thread | None = None
        self._ready: Any = getattr(self.loop, "_ready", None)  # the loop's queue of callbacks (asyncio's own)
        self._owner: int | None = None  # the thread that holds the turn for a borrowed run
        self._woken_at: int | None = None  # selector.sleeps when a borrowed call last woke the loop's thread

    def start(self, first: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Start the thread, run `first()` on the loop there, then the loop forever; wait for `first` and raise what
        it raised (the thread has then ended)."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.turn.acquire()
            try:
                try:
                    self.loop.run_until_complete(first())
                except BaseException as e:
                    failure.append(e)
                    return
                finally:
                    ready.set()
                self.loop.run_forever()
            finally:
                self.turn.release()

        self.thread = threading.Thread(target=main, name=self.name, daemon=True)
        self.thread.start()
        ready.wait()
        if failure:
            self.thread.join(5)
            raise failure[0]

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def send(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run `coro` on the loop's thread and wait (at most `timeout` seconds) for its result."""
        self.sent += 1
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """`coro`'s result: run on this thread while the loop's thread sleeps where it can, else sent to it."""
        try:
            self._check_thread()
        except RuntimeError:
            coro.close()
            raise
        return self._borrow(lambda: self._first_step(coro), lambda: self.send(coro))

    def now(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), a plain function that works on the loop's actors, on this thread while the loop's thread
        sleeps, with no task and no loop step: where it returns a coroutine, that goes on as `call` runs one (its
        first step at once, under the same turn). NOT_NOW, with nothing run, where the loop cannot be borrowed now
        (its thread is busy or has work left waiting): the caller then goes the usual way (`call`)."""
        self._check_thread()

        def step() -> tuple[concurrent.futures.Future[Any] | None, Any]:
            entered = self._enter()
            try:
                value = fn(*args)
            finally:
                self._leave(entered)
            if isinstance(value, CoroutineType):
                return self._first_step(value)
            self.borrowed += 1
            return None, value

        return self._borrow(step, lambda: NOT_NOW)

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if me == self._owner or (self.thread is not None and me == self.thread.ident):
            raise RuntimeError("a call into the embedded deepxd from inside one of its own runs (a callback or a "
                               "log handler?) would wait for itself")

    def _borrow(self, step: Callable[[], tuple[concurrent.futures.Future[Any] | None, Any]],
                refuse: Callable[[], Any]) -> Any:
        """step() with the turn held (this thread then stands in for the loop's), the first Ctrl-C held back until
        it is done; what it left waiting is waited for after the turn is given back. refuse() where the turn is not
        to be had."""
        global _held, _caught, _outer
        me = threading.get_ident()
        if self._ready is None or self.loop.get_debug() or (
                self._woken_at is not None and self._woken_at == self.selector.sleeps):
            return refuse()  # the last borrowed run left the loop's thread work that it has not done yet
        self._woken_at = None
        handler: Any = None
        if me == _MAIN:
            handler = _getsignal(_SIGINT)
            if handler is _on_sigint or callable(handler):  # not SIG_IGN, SIG_DFL or C's: nothing raises for those
                if handler is not _on_sigint:
                    _outer = handler
                    _setsignal(_SIGINT, _on_sigint)
                _held += 1
            else:
                handler = None
        got = False
        wait: concurrent.futures.Future[Any] | None = None
        value: Any = None
        try:
            got = self.turn.acquire(timeout=TURN_WAIT_S)
            if got:
                self._owner = me
                wait, value = step()
        finally:
            if got:
                self._owner = None
                self.turn.release()
            if handler is not None:
                _held -= 1
                if not _held:
                    if handler is not _on_sigint:
                        _setsignal(_SIGINT, handler)
                    if _caught:  # the held Ctrl-C, to its own handler (Python's raises KeyboardInterrupt)
                        _caught = False
                        handler(_SIGINT, sys._getframe())
        if not got:
            return refuse()
        return wait.result() if wait is not None else value

    def _enter(self) -> tuple[Any, Any]:
        """This thread as the loop's, for a borrowed step: the loop set as the running one. What _leave needs."""
        timers: Any = getattr(self.loop, "_scheduled", ())
        previous = events._get_running_loop()
        events._set_running_loop(self.loop)
        return previous, (timers[0] if timers else None)

    def _leave(self, entered: tuple[Any, Any]) -> None:
        """After a borrowed step: the running loop as it was; the loop's thread woken where the step left it
        callbacks or timers (and the next call sent to it until it has done them)."""
        previous, first_timer = entered
        events._set_running_loop(previous)
        timers: Any = getattr(self.loop, "_scheduled", ())
        if self._ready or (timers[0] if timers else None) is not first_timer:
            self.woken += 1
            self._woken_at = self.selector.sleeps
            self.loop.call_soon_threadsafe(_noop)  # wakes the loop's thread, which sleeps for as long as it knew of

    def _first_step(self, coro: Coroutine[Any, Any, Any]) -> tuple[concurrent.futures.Future[Any] | None, Any]:
        """With the turn held: make `coro` a task of the loop and run its first step on this thread. (None, its
        result) when that finished it (or its error raised); else (the future its result will come to, None)."""
        ready = self._ready
        entered = self._enter()
        try:
            task = self.loop.create_task(coro)
            if ready and getattr(ready[-1]._callback, "__self__", None) is task:  # its first step, queued just now
                try:
                    ready.pop()._run()
                except BaseException:  # KeyboardInterrupt, SystemExit: raised here, so not logged again later
                    if task.done() and not task.cancelled():
                        task.exception()
                    raise
        finally:
            self._leave(entered)
        if not task.done():
            self.resumed += 1
            wait: concurrent.futures.Future[Any] = concurrent.futures.Future()
            task.add_done_callback(lambda t: _settle(wait, t))
            return wait, None
        self.borrowed += 1
        if task.cancelled():
            raise concurrent.futures.CancelledError()
        error = task.exception()
        if error is not None:
            raise error
        return None, task.result()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and wait (at most `timeout` seconds) for the thread."""
        if self.alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            assert self.thread is not None
            self.thread.join(timeout)
