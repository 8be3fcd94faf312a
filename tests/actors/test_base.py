"""The actor runtime: tell/ask, every ask answered, stop semantics, supervision with a restart policy."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import ClassVar

import pytest

from deepx_core.errors import DeepxError
from deepxd.actors.base import Actor, ActorCrash, ActorStopped, Message, RestartPolicy, Supervisor


@dataclass(slots=True)
class Add(Message["Counter", int]):
    message: ClassVar[str] = "add"
    n: int


@dataclass(slots=True)
class Slow(Message["Counter", str]):
    message: ClassVar[str] = "slow"


@dataclass(slots=True)
class Bad(Message["Counter", None]):
    message: ClassVar[str] = "bad"


@dataclass(slots=True)
class Bug(Message["Counter", None]):
    message: ClassVar[str] = "bug"


@dataclass(slots=True)
class Crash(Message["Counter", None]):
    message: ClassVar[str] = "crash"


@dataclass(slots=True)
class Nope(Message["Counter", None]):
    """A message the Counter has no handler for."""

    message: ClassVar[str] = "nope"


@dataclass(slots=True)
class Long(Message["Nesting", "list[int]"]):
    message: ClassVar[str] = "long"
    skip: int


class Counter(Actor):
    role = "counter"

    def __init__(self, name: str = "counter") -> None:
        super().__init__(name)
        self.value = 0
        self.starts = 0
        self.failures: list[str] = []
        self.release = asyncio.Event()

    async def on_start(self) -> None:
        self.starts += 1

    async def on_failure(self, exc: BaseException) -> None:
        self.failures.append(str(exc))

    def on_add(self, n: int) -> int:
        self.value += n
        return self.value

    async def on_slow(self) -> str:
        await self.release.wait()
        return "done"

    def on_bad(self) -> None:
        raise DeepxError("bad input")

    def on_bug(self) -> None:
        raise ZeroDivisionError("a bug")

    def on_crash(self) -> None:
        raise ActorCrash("state corrupted")


async def test_tell_and_ask_run_in_order():
    a = Counter()
    ref = a.start()
    ref.tell(Add(2))
    ref.tell(Add(3))
    assert await ref.ask(Add(0)) == 5
    assert a.stats.handled == 3
    await a.stop()


async def test_a_failing_handler_answers_with_its_error_and_the_actor_keeps_serving():
    a = Counter()
    ref = a.start()
    with pytest.raises(DeepxError, match="bad input"):
        await ref.ask(Bad())
    with pytest.raises(ZeroDivisionError):
        await ref.ask(Bug())
    with pytest.raises(DeepxError, match="unknown message 'nope'"):
        await ref.ask(Nope())
    assert await ref.ask(Add(1)) == 1
    assert a.stats.errors == 3
    await a.stop()


async def test_stopping_fails_every_pending_ask_with_stopped():
    a = Counter()
    ref = a.start()
    slow = ref.ask_future(Slow())
    queued = [ref.ask_future(Add(1)) for _ in range(3)]
    await asyncio.sleep(0.01)
    await a.stop(drain=False)
    for f in [slow, *queued]:
        with pytest.raises(ActorStopped, match="stopped"):
            await f
    with pytest.raises(ActorStopped):
        await ref.ask(Add(1))
    with pytest.raises(ActorStopped):
        ref.tell(Add(1))


async def test_a_graceful_stop_drains_the_mailbox_first():
    a = Counter()
    ref = a.start()
    futures = [ref.ask_future(Add(1)) for _ in range(5)]
    await a.stop(drain=True)
    assert [f.result() for f in futures] == [1, 2, 3, 4, 5]
    assert a.state == "stopped"


async def test_the_supervisor_restarts_a_crashed_actor_and_logs_it(caplog):
    sup = Supervisor(RestartPolicy(max_restarts=2, window=60))
    a = Counter()
    ref = sup.start(a)
    await ref.ask(Add(5))
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ActorCrash):
            await ref.ask(Crash())
        assert await ref.ask(Add(1)) == 6  # the mailbox and the state survive the restart
    assert a.starts == 2 and a.stats.restarts == 1
    assert a.failures == ["state corrupted"]
    assert "actor 'counter' crashed" in caplog.text and "restarting" in caplog.text
    await sup.stop_all()
    assert a.state == "stopped"


async def test_the_supervisor_gives_up_past_its_policy(caplog):
    gave_up = []
    sup = Supervisor(RestartPolicy(max_restarts=1, window=60), on_give_up=lambda actor, exc: gave_up.append(actor.name))
    a = Counter()
    ref = sup.start(a)
    with pytest.raises(ActorCrash):
        await ref.ask(Crash())
    with caplog.at_level(logging.ERROR):
        with pytest.raises(ActorCrash):
            await ref.ask(Crash())
        for _ in range(50):
            if a.state == "stopped":
                break
            await asyncio.sleep(0.01)
    assert a.state == "stopped"
    assert gave_up == ["counter"]
    assert "giving up" in caplog.text
    with pytest.raises(ActorStopped):
        await ref.ask(Add(1))
    await sup.stop_all()


async def test_an_ask_with_a_timeout_says_which_actor_and_message():
    a = Counter()
    ref = a.start()
    with pytest.raises(DeepxError, match=r"actor .counter. did not answer .slow. within 0\.05 s"):
        await ref.ask(Slow(), timeout=0.05)
    a.release.set()
    await a.stop()


async def test_end_task_is_bounded_and_a_loop_that_swallows_its_cancel_ends_with_its_actor() -> None:
    """redis-py sometimes takes a cancellation inside a command for a lost connection and retries: a background
    loop that swallowed its cancel kept a daemon's stop waiting until it was killed. end_task waits at most its
    timeout, and a loop that runs while its actor is alive ends once the actor stops."""
    from deepxd.actors.base import end_task

    class Looper(Actor):
        rounds = 0

        async def loop(self, swallow: bool) -> None:
            while self.alive:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    if not swallow:
                        raise
                self.rounds += 1

    a = Looper("looper")
    a.start()
    polite = asyncio.ensure_future(a.loop(False))
    await asyncio.sleep(0.05)
    await end_task(polite, 3600)  # returns when the task ends (were it to wait its timeout, the test's would fire)
    assert polite.cancelled()
    rude = asyncio.ensure_future(a.loop(True))
    await asyncio.sleep(0.05)
    before = a.rounds
    await end_task(rude, 0.3)  # the cancel is swallowed: bounded by the timeout, not forever
    assert not rude.done() and a.rounds > before  # it returned while the loop still ran, after waiting for it
    await a.stop()  # no longer alive: the loop ends at its next round
    await asyncio.wait({rude}, timeout=2.0)
    assert rude.done()


async def test_an_ask_its_asker_gave_up_on_is_not_handled_and_doing_says_what_runs():
    """An ask that timed out while the actor was busy stayed in its mailbox and was handled later, for nobody; now
    it is skipped. `doing` names the message being handled (what `deepxctl actors ls` shows)."""
    a = Counter()
    ref = a.start()
    slow = asyncio.ensure_future(ref.ask(Slow()))
    await asyncio.sleep(0.01)
    assert a.doing == "slow"
    with pytest.raises(DeepxError, match=r"did not answer 'add' within 0\.05 s"):
        await ref.ask(Add(5), timeout=0.05)
    handled = a.stats.handled
    a.release.set()
    assert await slow == "done"
    assert await ref.ask(Add(1)) == 1  # the 5 was never added
    assert a.stats.handled == handled + 2 and a.doing == ""
    await a.stop()


class Nesting(Counter):
    """A handler that, while it waits, handles the waiting `add` messages nested (as a worker between slices)."""

    async def on_long(self, skip: int) -> list[int]:
        seen = []
        while not self.release.is_set():
            env = self.take_next(lambda e: isinstance(e.message, Add) and e.message.n != skip,
                                 lambda e: isinstance(e.message, Add))  # past the skipped adds, never past others
            if env is None:
                await asyncio.sleep(0.01)
                continue
            assert isinstance(env.message, Add)
            seen.append(env.message.n)
            await self.handle_nested(env)
        return seen


async def test_take_next_takes_what_it_accepts_in_order_passing_only_what_it_may():
    """A handler takes waiting messages out of order only past those `passes` allows; the rest stay queued in
    their order and are handled after it; every ask is answered once."""
    a = Nesting()
    ref = a.start()
    long = asyncio.ensure_future(ref.ask(Long(5)))
    await asyncio.sleep(0.02)
    asks = [asyncio.ensure_future(ref.ask(Add(n))) for n in (1, 5, 2)]
    stop_here = asyncio.ensure_future(ref.ask(Slow()))  # not an add: nothing after it is taken
    late = asyncio.ensure_future(ref.ask(Add(7)))
    await asyncio.sleep(0.1)
    assert [f.done() for f in asks] == [True, False, True] and not late.done()
    assert asks[0].result() == 1 and asks[2].result() == 3
    a.release.set()
    assert await long == [1, 2]
    assert await asks[1] == 8 and await stop_here == "done" and await late == 15  # then in mailbox order
    assert a.stats.handled == 6
    await a.stop()
