"""deepx_sdk/loopthread.py: the embedded daemon's loop, which the calling thread borrows while the loop sleeps."""

from __future__ import annotations

import _thread
import asyncio
import signal
import threading
import time
from collections.abc import Iterator

import pytest

import deepx_sdk.loopthread as lt
from deepx_sdk.loopthread import LoopThread


async def _nothing() -> None:
    pass


def _asleep(runner: LoopThread) -> None:
    """Until the loop's thread sleeps in its selector with nothing left to do, as a call that borrows the loop needs
    it (it gets there within microseconds of its last work on an idle machine; a loaded one may take longer than any
    fixed sleep)."""
    deadline = time.monotonic() + 30
    while runner.turn.locked() or runner._ready or runner._woken_at == runner.selector.sleeps:
        assert time.monotonic() < deadline, "the loop's thread did not go to sleep"
        time.sleep(0.001)


@pytest.fixture
def runner() -> Iterator[LoopThread]:
    r = LoopThread("test-loop")
    r.start(_nothing)
    _asleep(r)
    yield r
    r.stop()
    assert not r.alive()


async def where() -> str:
    """The running thread's name, with the loop that asyncio sees as running."""
    asyncio.get_running_loop()
    return threading.current_thread().name


def _on_the_main_thread() -> None:
    """The SIGINT tests need pytest's main thread (signals reach Python's main thread only): where they do not get
    it, they fail saying so rather than pass unchecked."""
    assert threading.current_thread() is threading.main_thread(), "signals reach Python's main thread only"


@pytest.fixture
def sigint_default() -> Iterator[None]:
    """Python's own SIGINT handler for the test, however the suite was started (a shell's `&` job ignores SIGINT,
    and Python then leaves it ignored: interrupt_main would do nothing)."""
    _on_the_main_thread()
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_coroutine_that_never_waits_runs_on_the_callers_thread(runner: LoopThread) -> None:
    assert runner.call(where()) == threading.current_thread().name
    assert (runner.borrowed, runner.resumed, runner.sent) == (1, 0, 0)
    assert runner.send(where()) == "test-loop"
    assert runner.sent == 1
    with pytest.raises(RuntimeError):  # no loop runs on this thread outside a call
        asyncio.get_running_loop()


def test_a_coroutine_that_waits_is_finished_by_the_loops_thread(runner: LoopThread) -> None:
    async def wait_then_where(delay: float) -> tuple[str, str]:
        first = threading.current_thread().name
        await asyncio.sleep(delay)
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(fut.set_result, "set")
        assert await fut == "set"
        return first, threading.current_thread().name

    assert runner.call(wait_then_where(0.01)) == (threading.current_thread().name, "test-loop")
    assert runner.call(wait_then_where(0)) == (threading.current_thread().name, "test-loop")
    assert runner.resumed == 2


def test_errors_come_back_from_either_thread(runner: LoopThread) -> None:
    async def fail(wait: bool) -> None:
        if wait:
            await asyncio.sleep(0.001)
        raise ValueError(f"failed (waited: {wait})")

    with pytest.raises(ValueError, match="waited: False"):
        runner.call(fail(False))
    with pytest.raises(ValueError, match="waited: True"):
        runner.call(fail(True))
    assert runner.call(where()) == threading.current_thread().name  # the turn was given back both times


def test_what_a_borrowed_call_leaves_the_loop_runs_at_once(runner: LoopThread) -> None:
    """The loop's thread sleeps in its selector with no timeout; a callback, a task or a timer that a borrowed call
    leaves behind wakes it (it would otherwise wait for an unrelated event)."""
    done = {name: threading.Event() for name in ("soon", "task", "timer")}
    tasks = []

    async def leave_work() -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(done["soon"].set)

        async def task() -> None:
            done["task"].set()

        tasks.append(loop.create_task(task()))
        loop.call_later(0.05, done["timer"].set)

    _asleep(runner)
    runner.call(leave_work())
    assert runner.borrowed == 1 and runner.woken == 1
    for name, event in done.items():  # unwoken, the loop's thread would sleep for ever: these would never be set
        assert event.wait(30), name


def _keep_busy(runner: LoopThread) -> threading.Event:
    """The loop's thread running a long callback (it holds the turn meanwhile), from when this returns until the
    event it returns is set (a callback of a fixed 0.3 s took the calls after it to come within that time)."""
    started, release = threading.Event(), threading.Event()

    def busy() -> None:
        started.set()
        release.wait(60)

    runner.loop.call_soon_threadsafe(busy)
    assert started.wait(30)
    return release


def _release_once_sent(runner: LoopThread, release: threading.Event) -> None:
    """Set `release`, which a callback of the loop's thread waits for, once a call has been sent to that thread (or
    after 30 s): the call is made while that thread is busy, however late this thread gets to make it."""
    sent = runner.sent

    def watch() -> None:
        deadline = time.monotonic() + 30
        while runner.sent == sent and time.monotonic() < deadline:
            time.sleep(0.001)
        release.set()

    threading.Thread(target=watch, daemon=True).start()


def test_a_busy_loop_thread_gets_the_coroutine_instead(runner: LoopThread) -> None:
    """While the loop's thread runs a long callback (it holds the turn), a call waits TURN_WAIT_S at most, then
    sends the coroutine there: it runs after the callback, on that thread."""
    _release_once_sent(runner, _keep_busy(runner))
    assert runner.call(where()) == "test-loop"
    assert runner.sent == 1 and runner.borrowed == 0


def test_calls_from_many_threads_at_once(runner: LoopThread) -> None:
    """Borrowed and sent calls interleave from several threads; each coroutine runs whole, one at a time."""
    state = {"inside": 0, "most": 0, "runs": 0}

    async def critical(k: int) -> int:
        if k % 3 == 0:
            await asyncio.sleep(0)  # this one is finished by the loop's thread
        state["inside"] += 1  # from here to the return nothing awaits: no other code of the loop may run meanwhile
        state["most"] = max(state["most"], state["inside"])
        time.sleep(0.0005)
        state["inside"] -= 1
        state["runs"] += 1
        return k

    results: list[int] = []
    lock = threading.Lock()

    def worker(base: int) -> None:
        for k in range(base, base + 30):
            value = runner.call(critical(k))
            with lock:
                results.append(value)

    threads = [threading.Thread(target=worker, args=(i * 100,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == sorted(k for i in range(4) for k in range(i * 100, i * 100 + 30))
    assert state["runs"] == 120 and state["most"] == 1
    assert runner.borrowed + runner.resumed > 0 and runner.sent > 0


def test_ctrl_c_waits_for_the_end_of_a_borrowed_run(runner: LoopThread, sigint_default: None) -> None:
    """SIGINT in the middle of a borrowed run on the main thread: the run finishes (the actors' state is never
    left half changed), then KeyboardInterrupt is raised. Outside a run, SIGINT interrupts as usual."""
    _on_the_main_thread()
    finished = []

    async def interrupted() -> None:
        _thread.interrupt_main()
        for _ in range(1000):  # the handler runs between these bytecodes; the run goes on
            time.sleep(0)
        finished.append(True)

    with pytest.raises(KeyboardInterrupt):
        runner.call(interrupted())
    assert finished == [True]
    assert runner.call(where()) == threading.current_thread().name
    with pytest.raises(KeyboardInterrupt):
        _thread.interrupt_main()
        for _ in range(1000):
            time.sleep(0)
    assert not lt._held and not lt._caught


def test_sigint_is_left_to_its_handler_between_calls(runner: LoopThread, sigint_default: None) -> None:
    """The deferring handler is there only during a borrowed run: asyncio.run's own Ctrl-C handling (which it
    installs only over the default handler), and anything else, sees the default handler between calls."""
    _on_the_main_thread()
    seen = []

    async def look() -> None:
        seen.append(signal.getsignal(signal.SIGINT))

    before = signal.getsignal(signal.SIGINT)
    runner.call(look())
    assert seen == [lt._on_sigint] and runner.borrowed == 1
    assert signal.getsignal(signal.SIGINT) is before is signal.default_int_handler


def test_the_programs_own_sigint_handler_is_called_after_a_borrowed_run(runner: LoopThread) -> None:
    """A handler the program installed itself (a checkpoint on Ctrl-C) does not stop the loop being borrowed; a
    Ctrl-C during the run reaches it once the run has finished, with the handler back in place."""
    _on_the_main_thread()
    seen: list[str] = []

    def own(signum: int, frame: object) -> None:
        seen.append("handler")

    def interrupted() -> str:
        _thread.interrupt_main()
        for _ in range(1000):
            time.sleep(0)
        seen.append("run finished")
        return threading.current_thread().name

    before = signal.signal(signal.SIGINT, own)
    try:
        assert runner.call(where()) == threading.current_thread().name
        assert runner.now(interrupted) == threading.current_thread().name
        assert seen == ["run finished", "handler"]
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, before)
    assert runner.borrowed == 2 and runner.sent == 0
    assert not lt._held and not lt._caught


def test_an_ignored_sigint_still_borrows_the_loop(runner: LoopThread) -> None:
    """SIGINT ignored (a job started with `&`, nohup): calls borrow the loop as with Python's handler, and SIGINT stays
    ignored during the run."""
    _on_the_main_thread()
    seen = []

    async def look() -> str:
        seen.append(signal.getsignal(signal.SIGINT))
        return threading.current_thread().name

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert runner.call(look()) == threading.current_thread().name
        assert runner.now(_where_now) == threading.current_thread().name
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert (runner.borrowed, runner.sent) == (2, 0)


def test_asyncio_debug_mode_keeps_calls_on_the_loops_thread() -> None:
    r = LoopThread("test-loop")
    r.loop.set_debug(True)  # asyncio then checks that loop methods are called from the loop's thread
    r.start(_nothing)
    try:
        assert r.call(where()) == "test-loop"
    finally:
        r.stop()


def test_a_failing_first_coroutine_is_raised_by_start() -> None:
    async def broken() -> None:
        raise OSError("no socket")

    r = LoopThread("test-loop")
    with pytest.raises(OSError, match="no socket"):
        r.start(broken)
    assert not r.alive()


def test_work_left_for_the_loops_thread_goes_first(runner: LoopThread) -> None:
    """A borrowed run that left the loop's thread a callback wakes it; calls go to that thread (behind the callback)
    until it has done its work and slept again, then they borrow again."""
    order: list[str] = []
    gate = threading.Event()

    def slow() -> None:
        gate.wait(30)
        order.append("callback")

    async def leave() -> None:
        asyncio.get_running_loop().call_soon(slow)

    async def mark() -> str:
        order.append("call")
        return threading.current_thread().name

    runner.call(leave())
    assert runner.woken == 1
    _release_once_sent(runner, gate)  # the callback goes on until the call below was sent (a fixed 0.05 s was not)
    assert runner.call(mark()) == "test-loop"  # sent: it runs after the callback, on the loop's thread
    assert order == ["callback", "call"]
    _asleep(runner)  # the loop's thread has slept since
    assert runner.call(mark()) == threading.current_thread().name


def test_a_call_from_inside_a_borrowed_run_is_refused(runner: LoopThread) -> None:
    """A re-entrant call (a log handler or a callback that calls the SDK during a program) would wait for the turn
    it holds itself: refused with an error instead of a hang."""
    async def inner() -> None:
        pass

    async def outer() -> str:
        try:
            runner.call(inner())
        except RuntimeError as e:
            return str(e)
        return "no error"

    assert "inside one of its own runs" in runner.call(outer())
    assert runner.call(where()) == threading.current_thread().name


def test_tasks_timeouts_and_context_variables_inside_a_borrowed_run(runner: LoopThread) -> None:
    """The coroutine is a task of the loop from its first step: current_task, asyncio.timeout and wait_for work, a
    context variable it sets stays in its own context, and a token set before a wait resets after it."""
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def task_things(wait: bool) -> str:
        assert asyncio.current_task() is not None
        token = var.set("inside")
        try:
            fut = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(fut.set_result, "ok")
            if wait:
                async with asyncio.timeout(5):
                    await asyncio.sleep(0)
                return str(await asyncio.wait_for(fut, 5))
            return "ok"
        finally:
            var.reset(token)

    assert runner.call(task_things(False)) == "ok"
    assert runner.call(task_things(True)) == "ok"
    assert var.get() == "unset"


def test_a_cancelled_coroutine_raises_what_it_raised_before(runner: LoopThread) -> None:
    """concurrent.futures.CancelledError (an Exception), as run_coroutine_threadsafe's result() raised it."""
    import concurrent.futures

    async def cancelled(wait: bool) -> None:
        if wait:
            await asyncio.sleep(0)
        fut = asyncio.get_running_loop().create_future()
        fut.cancel()
        await fut

    for wait in (False, True):
        with pytest.raises(concurrent.futures.CancelledError):
            runner.call(cancelled(wait))


def test_a_second_ctrl_c_interrupts_at_once(runner: LoopThread, sigint_default: None) -> None:
    _on_the_main_thread()
    reached = []

    async def twice() -> None:
        _thread.interrupt_main()
        for _ in range(100):
            time.sleep(0)
        reached.append("after the first")
        _thread.interrupt_main()
        for _ in range(100):
            time.sleep(0)
        reached.append("after the second")

    with pytest.raises(KeyboardInterrupt):
        runner.call(twice())
    assert reached == ["after the first"]
    assert not lt._held and not lt._caught
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _asleep(runner)
    assert runner.call(where()) == threading.current_thread().name  # the turn was given back


def _where_now() -> str:
    """now()'s plain-function counterpart of where()."""
    asyncio.get_running_loop()
    return threading.current_thread().name


def test_now_runs_a_plain_function_on_the_callers_thread_as_the_loops(runner: LoopThread) -> None:
    """LoopThread.now: a function (no coroutine, no task) with the loop as the running one, on this thread."""
    assert runner.now(_where_now) == threading.current_thread().name
    assert (runner.borrowed, runner.resumed, runner.sent) == (1, 0, 0)
    with pytest.raises(RuntimeError):  # no loop runs on this thread outside it
        asyncio.get_running_loop()
    with pytest.raises(ValueError, match="raised"):
        runner.now(lambda: (_ for _ in ()).throw(ValueError("raised")))
    assert runner.now(_where_now) == threading.current_thread().name  # the turn was given back


def test_now_goes_on_with_a_coroutine_that_its_function_returns(runner: LoopThread) -> None:
    """What the function hands on (the rest of the work, which waits) runs as call() runs a coroutine: its first step
    at once, under the same turn, and the loop's thread finishes it."""
    async def rest(first: str) -> tuple[str, str, str]:
        here = threading.current_thread().name
        await asyncio.sleep(0.01)
        return first, here, threading.current_thread().name

    me = threading.current_thread().name
    assert runner.now(lambda: rest(_where_now())) == (me, me, "test-loop")
    assert runner.resumed == 1


def test_now_answers_not_now_where_the_loop_is_not_to_be_borrowed(runner: LoopThread) -> None:
    """Busy loop thread or work left for it: nothing runs, NOT_NOW comes back."""
    ran: list[bool] = []
    release = _keep_busy(runner)
    try:
        assert runner.now(ran.append, True) is lt.NOT_NOW
    finally:
        release.set()
    _asleep(runner)
    gate = threading.Event()

    async def leave() -> None:
        asyncio.get_running_loop().call_soon(gate.wait, 30)

    runner.call(leave())
    try:
        assert runner.now(ran.append, True) is lt.NOT_NOW  # the callback it left is not done yet
    finally:
        gate.set()
    _asleep(runner)
    assert runner.now(ran.append, True) is None and ran == [True]


def test_ctrl_c_waits_for_the_end_of_a_function_run_now(runner: LoopThread, sigint_default: None) -> None:
    _on_the_main_thread()
    finished = []

    def interrupted() -> None:
        _thread.interrupt_main()
        for _ in range(1000):
            time.sleep(0)
        finished.append(True)

    with pytest.raises(KeyboardInterrupt):
        runner.now(interrupted)
    assert finished == [True]
    assert not lt._held and not lt._caught


def test_now_from_inside_a_borrowed_run_is_refused(runner: LoopThread) -> None:
    async def outer() -> str:
        try:
            runner.now(_where_now)
        except RuntimeError as e:
            return str(e)
        return "no error"

    assert "inside one of its own runs" in runner.call(outer())
