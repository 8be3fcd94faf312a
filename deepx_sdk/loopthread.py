"""An event loop in a background thread that the calling thread may borrow (the embedded daemon's loop).

The embedded deepxd's actors live on an asyncio loop in a thread of their own, so that they serve deepxctl and
other clients while the notebook is idle. Handing each program to that thread and the answer back costs two thread
wake-ups (about 0.1-0.2 ms each on a small VM), more than the scheduler and the op worker spend on a known program.

`LoopThread.call` avoids both where it can. The loop's thread holds a lock, its *turn*, whenever it runs loop code,
and lets go of it only while it sleeps in the selector, waiting for I/O or a timer. A caller that gets the turn
(without waiting for it) knows the loop's thread is asleep and will stay so until the turn is given back, so it
runs the coroutine itself, on its own thread, with that loop set as the running loop:

- a coroutine that never waits (the actors answer an ask directly when they are idle) finishes there, with no
  thread hand-off at all;
- one that does wait (an actor busy with another message, a socket, a worker thread) is handed, where it waits, to
  the loop's thread, which finishes it as a task; the caller then waits for the answer as before;
- the loop's thread is woken afterwards if the coroutine left it callbacks or timers.

Where the turn is taken (the loop's thread is busy, or in asyncio's debug mode, which checks threads), the
coroutine goes to the loop's thread as `asyncio.run_coroutine_threadsafe` sends it.

Ctrl-C: on the main thread, a borrowed run is not interrupted half-way (the actors' state would be left half
changed); the KeyboardInterrupt is raised when it has finished. Elsewhere in the program SIGINT behaves as usual.
"""

from __future__ import annotations

import asyncio
import logging
import selectors
import signal
import threading
from _signal import getsignal as _getsignal  # signal.getsignal without its enum conversion (20x the cost)
from asyncio import events
from collections.abc import Callable, Coroutine, Generator
from typing import Any

log = logging.getLogger(__name__)

#: how long `call` waits for the loop's thread to go to sleep before it sends the coroutine there instead
TURN_WAIT_S = 0.002


class _TurnSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The platform's selector, which gives up the loop thread's turn while it waits (and only then)."""

    def __init__(self, turn: threading.Lock) -> None:
        super().__init__()
        self._turn = turn

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:  # a poll: callbacks are ready, the thread goes on at once
            return super().select(timeout)
        self._turn.release()
        try:
            return super().select(timeout)
        finally:
            self._turn.acquire()


class _Resume:
    """Await this to go on with coroutine `coro`, which was started elsewhere and yielded `first` (the future it
    waits for, or None): the task running this waits for what the coroutine waits for, and passes everything on."""

    __slots__ = ("coro", "first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self.coro, self.first = coro, first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self.coro, self.first
        self.first = None
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # the task was cancelled: the coroutine is told where it waits
                try:
                    value = coro.throw(e)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _finish(coro: Coroutine[Any, Any, Any], first: Any) -> Any:
    return await _Resume(coro, first)


def _noop() -> None:
    pass


# SIGINT on the main thread while it runs a borrowed coroutine: held until the run has finished
_SIGINT = int(signal.SIGINT)
_held = 0
_caught = False


def _on_sigint(signum: int, frame: Any) -> None:
    global _caught
    if _held:
        _caught = True
        return
    signal.default_int_handler(signum, frame)


class LoopThread:
    """An asyncio loop run forever by a daemon thread named `name`, which `call` may borrow (see the module)."""

    def __init__(self, name: str) -> None:
        self.turn = threading.Lock()
        self.loop = asyncio.SelectorEventLoop(_TurnSelector(self.turn))
        self.name = name
        self.borrowed = 0  # calls run on the caller's thread to the end
        self.resumed = 0  # calls run on the caller's thread until they waited, then finished by the loop's thread
        self.sent = 0  # calls sent to the loop's thread from the start
        self.woken = 0  # borrowed calls that left the loop's thread something to do
        self.thread: threading.Thread | None = None
        self._sigint_was: Any = None

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
        loop = self.loop
        # the loop's thread, if awake, is mostly about to sleep again (a timer's tick): worth a short wait
        if loop.get_debug() or not self.turn.acquire(timeout=TURN_WAIT_S):
            return self.send(coro)
        global _held, _caught
        main = threading.current_thread() is threading.main_thread()
        if main:
            handler = _getsignal(_SIGINT)
            if handler is not _on_sigint:
                if handler is not signal.default_int_handler:  # someone else's: it may raise anywhere
                    self.turn.release()
                    return self.send(coro)
                self._sigint_was = signal.signal(signal.SIGINT, _on_sigint)
            _held += 1
        ready: Any = getattr(loop, "_ready", None)
        timers: Any = getattr(loop, "_scheduled", None)
        first_timer = timers[0] if timers else None
        previous = events._get_running_loop()
        events._set_running_loop(loop)
        waiting: Any = None
        try:
            try:
                yielded = coro.send(None)
            except StopIteration as stop:
                self.borrowed += 1
                return stop.value
            # it waits for something: the loop's thread goes on with it
            waiting = asyncio.run_coroutine_threadsafe(_finish(coro, yielded), loop)
            self.resumed += 1
        finally:
            events._set_running_loop(previous)
            if ready is None or ready or (timers[0] if timers else None) is not first_timer:
                self.woken += 1
                loop.call_soon_threadsafe(_noop)  # wakes the loop's thread, which sleeps for as long as it knew of
            self.turn.release()
            if main:
                _held -= 1
                if _caught and not _held:
                    _caught = False
                    raise KeyboardInterrupt
        return waiting.result()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and wait (at most `timeout` seconds) for the thread; put back the SIGINT handler."""
        if self.alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            assert self.thread is not None
            self.thread.join(timeout)
        if (self._sigint_was is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is _on_sigint):
            signal.signal(signal.SIGINT, self._sigint_was)
        self._sigint_was = None
