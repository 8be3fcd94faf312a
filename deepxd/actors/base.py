"""Actors: an actor owns its state and a mailbox; others hold an ActorRef and `tell` or `await ask`.

- A message is a dataclass of `Message[A, R]` (deepxd/actors/messages.py has every actor's): sent to an actor of type A,
  answered with an R; the actor's handler is its method `on_<message>` (sync or async), given the fields in order.
- Every ask is answered: with the handler's result, with the handler's exception (the actor keeps serving), or, when
  the actor stops, with ActorStopped. An ask its asker gave up on before it was handled (a timeout, a cancelled
  task: its future cancelled) is skipped.
- A handler that raises `ActorCrash` (or a failing `on_start`) crashes the actor: its mailbox is kept, and the
  Supervisor restarts it (`on_failure`, then a fresh `on_start`) within its policy of `max_restarts` per `window`
  seconds, logging each restart; past the policy the actor stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import operator
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import CoroutineType
from typing import Any, ClassVar, Generic, Self, TypeVar, cast

from deepx_core.errors import DeepxError

log = logging.getLogger(__name__)


class ActorStopped(DeepxError):
    """The actor stopped before it answered."""


class ActorCrash(Exception):
    """Raised by a handler whose actor can no longer be trusted to serve: the supervisor restarts it."""


class _Stop:
    """The poison pill: the mailbox is drained up to it, then the actor stops."""


_STOP = _Stop()

A = TypeVar("A", bound="Actor")
A_contra = TypeVar("A_contra", bound="Actor", contravariant=True)
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Message(Generic[A_contra, R_co]):
    """A message to an actor of type A, answered with an R. Subclasses are dataclasses (deepxd/actors/messages.py):
    `message` names the handler (`on_<message>`), which takes the fields as its arguments, in order."""

    __slots__ = ()
    message: ClassVar[str]

    def args(self) -> tuple[Any, ...]:
        """The fields' values, in order: the handler's arguments."""
        get = _ARGS.get(type(self))
        if get is None:
            get = _ARGS[type(self)] = _fields_getter(type(self))
        return get(self)


_ARGS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}
_NOW: dict[str, str] = {}  # a message's name -> the name of the method that answers it with `ref.now`


def _fields_getter(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    names = [f.name for f in dataclasses.fields(cls)]
    if not names:
        return lambda m: ()
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda m: (one(m),)
    return operator.attrgetter(*names)  # a tuple, made in C


@dataclass(slots=True)
class _Crash(Message["Actor", None]):
    """Makes the actor's task raise a crash that happened in a direct ask (see Actor._failed)."""

    message: ClassVar[str] = "\0crash"
    exc: BaseException


@dataclass(slots=True)
class Envelope:
    message: Message[Any, Any]
    future: asyncio.Future[Any] | None

    @property
    def name(self) -> str:
        return self.message.message


@dataclass
class ActorStats:
    handled: int = 0
    errors: int = 0
    restarts: int = 0
    started: float = 0.0
    last_error: str = ""
    busy_s: float = 0.0
    by_message: dict[str, int] = field(default_factory=dict)


class Actor:
    """Subclass, set `role`, and write `on_<message>` handlers. Handlers run one at a time, in mailbox order."""

    role = "actor"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.role
        self.mailbox: asyncio.Queue[Envelope | _Stop] = asyncio.Queue()
        self.state = "new"  # new -> running -> (crashed -> running)* -> stopping -> stopped
        self.stats = ActorStats()
        self._task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._handlers: dict[str, Any] = {}
        self._busy = False  # a message is being handled (by the actor's task, or directly for an asker)
        self._held: Envelope | _Stop | None = None  # the next message, taken by the actor's task while busy
        self.doing = ""  # the message being handled, for `deepxctl actors ls`
        self.doing_since = 0.0  # time.perf_counter() when it began
        self._idle = asyncio.Event()
        self._idle.set()
        self.start_ended = asyncio.Event()  # set once the first on_start has returned or raised
        self.ref = cast("ActorRef[Self]", ActorRef(self))

    # -- lifecycle hooks
    async def on_start(self) -> None:
        """Called before the first message, and again after each restart."""

    async def on_stop(self) -> None:
        """Called once, after the last message."""

    async def on_failure(self, exc: BaseException) -> None:
        """Called after a crash, before the restart."""

    # -- running
    def start(self) -> ActorRef[Self]:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"actor:{self.name}")
        return self.ref

    async def _run(self) -> None:
        self.stats.started = time.time()
        try:
            await self.on_start()
        finally:
            self.start_ended.set()  # (started, or failed: its supervisor has it then)
        self.state = "running"
        while True:
            env = await self.mailbox.get()
            if self._busy:  # an ask is being answered directly (see ActorRef.ask): held till its end
                self._held = env
                while self._busy:
                    await self._idle.wait()
                held, self._held = self._held, None
                if held is None:
                    continue  # answered meanwhile (answer_waiting)
                env = held
            if isinstance(env, _Stop):
                break
            if isinstance(env.message, _Crash):
                raise env.message.exc
            if env.future is not None and env.future.cancelled():
                continue  # its asker gave up (a timeout): nobody reads the answer
            self._busy = True
            self._idle.clear()
            self.doing, self.doing_since = env.name, time.perf_counter()
            try:
                await self._handle(env, self.doing_since)
            finally:
                self._busy = False
                self.doing = ""
                self._idle.set()

    def answer_waiting(self, names: frozenset[str]) -> int:
        """Answer now, in order, the messages waiting in the mailbox whose names are in `names` (queries with plain
        function handlers), the others left queued in their order; how many were answered. A handler calls it at a
        point where its state is whole (between a long program's slices), so that those queries do not wait for its
        end."""
        box, held = self.mailbox, self._held
        if box.empty() and held is None:
            return 0
        waiting = [box.get_nowait() for _ in range(box.qsize())]
        answered = 0
        if isinstance(held, Envelope) and held.name in names:  # the oldest: the actor's task holds it
            self._held = None
            waiting.insert(0, held)
        for env in waiting:
            if not isinstance(env, Envelope) or env.name not in names:
                box.put_nowait(env)
                continue
            if env.future is not None and env.future.done():
                continue  # its asker gave up
            t0 = time.perf_counter()
            try:
                result = getattr(self, f"on_{env.name}")(*env.message.args())
            except Exception as e:
                self._answer_error(env, e)
                self._count_error(env.name, e)
            else:
                if env.future is not None and not env.future.done():
                    env.future.set_result(result)
            self.stats.handled += 1
            self.stats.busy_s += time.perf_counter() - t0
            self.stats.by_message[env.name] = self.stats.by_message.get(env.name, 0) + 1
            answered += 1
        return answered

    def take_next(self, accept: Callable[[Envelope], bool],
                  passes: Callable[[Envelope], bool] | None = None) -> Envelope | None:
        """The oldest message waiting that accept(it) takes (its asker still waiting), taken out of the mailbox; the
        look goes on past a message not taken only where passes(it) says so (None: never past one), else it ends
        there: None, and the mailbox as it was. For a handler that handles it nested, at a point where its state
        is whole (see OpWorker._interleave); `passes` says what it may overtake (it keeps the order of the rest)."""
        def live(env: Envelope | _Stop | None) -> bool:
            return (isinstance(env, Envelope) and (env.future is None or not env.future.done())
                    and not isinstance(env.message, _Crash))

        held = self._held
        waiting = [] if held is None else [held]  # the oldest: the actor's task holds it while a direct ask is answered
        box = self.mailbox
        waiting.extend(box.get_nowait() for _ in range(box.qsize()))
        taken = None
        try:
            for k, env in enumerate(waiting):
                if live(env) and accept(env):  # type: ignore[arg-type]
                    taken = k
                    break
                if passes is None or not live(env) or not passes(env):  # type: ignore[arg-type]
                    break
        except Exception:  # a malformed message: nothing taken, the mailbox as it was
            log.exception("%s: looking through the mailbox failed; nothing taken", self.name)
            taken = None
        if taken is None:
            rest = waiting[1:] if held is not None else waiting
        else:
            env = waiting[taken]
            if held is not None:
                if taken == 0:
                    self._held = None
                rest = [e for k, e in enumerate(waiting) if k and k != taken]
            else:
                rest = [e for k, e in enumerate(waiting) if k != taken]
        for e in rest:
            box.put_nowait(e)
        return None if taken is None else waiting[taken]  # type: ignore[return-value]

    def message_waiting(self) -> None:
        """Called as a message is put in the mailbox (a handler that takes waiting messages nested may start to)."""

    async def handle_nested(self, env: Envelope) -> None:
        """Handle `env` now, inside the handler that calls this (take_next gave it), counted as any message."""
        await self._handle(env, time.perf_counter())

    def idle(self) -> bool:
        """Nothing being handled and nothing waiting: an ask would be answered directly (_direct)."""
        return not self._busy and self.state == "running" and self.mailbox.empty()

    async def _direct(self, name: str, args: tuple[Any, ...], handler: Any = None, count: bool = True) -> Any:
        """Answer an ask in the asker's task: only while the mailbox is empty and nothing is being handled, so
        messages are still handled one at a time and in order; it saves two trips through the event loop.
        handler: what answers it, where not on_<name>; count=False: the rest of a message `now` began (counted
        there), its time added to the busy time."""
        t0 = self._begin(name)
        if handler is None:
            handler = self._handlers.get(name)
            if handler is None:
                handler = self._handlers[name] = getattr(self, f"on_{name}", None)
        try:
            if handler is None:
                raise DeepxError(f"{self.name}: unknown message '{name}'")
            result = handler(*args)
            if type(result) is CoroutineType or inspect.isawaitable(result):
                result = await result
            return result
        except Exception as e:
            self._failed(name, e)
            raise
        finally:
            self._end(name, t0, count)

    def now(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Answer message `name` with fn(*args), a plain function, where the actor is idle(): as _direct answers an
        ask, with no coroutine, on a thread that stands in for the loop's (LoopThread.now: the embedded daemon's
        fast path). Where fn hands on a coroutine (the rest needs an await), that rest is answered as an ask is,
        the actor busy meanwhile, and the message counted once."""
        t0 = self._begin(name)
        try:
            value = fn(*args)
        except Exception as e:
            self._failed(name, e)
            raise
        finally:
            self._end(name, t0)
        if type(value) is CoroutineType:
            # busy from now, not from the rest's first step: a caller on the loop's own thread (a transport's
            # callback) starts that step a loop turn later, and no ask may be answered in between
            self._begin(name)
            return self._direct(name, (), lambda: value, count=False)
        return value

    def _begin(self, name: str) -> float:
        self._busy = True
        self._idle.clear()
        t0 = time.perf_counter()
        self.doing, self.doing_since = name, t0
        return t0

    def _end(self, name: str, t0: float, count: bool = True) -> None:
        self._busy = False
        self.doing = ""
        self._idle.set()
        stats = self.stats
        stats.busy_s += time.perf_counter() - t0
        if count:
            stats.handled += 1
            stats.by_message[name] = stats.by_message.get(name, 0) + 1

    def _failed(self, name: str, e: Exception) -> None:
        self._count_error(name, e)
        if isinstance(e, ActorCrash):
            self.mailbox.put_nowait(Envelope(_Crash(e), None))  # the actor's own task crashes on it

    async def _handle(self, env: Envelope, t0: float) -> None:
        handler = getattr(self, f"on_{env.name}", None)
        try:
            if handler is None:
                raise DeepxError(f"{self.name}: unknown message '{env.name}'")
            result = handler(*env.message.args())
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            if env.future is not None and not env.future.done():
                env.future.set_exception(ActorStopped(f"actor '{self.name}' stopped while handling '{env.name}'"))
            raise
        except ActorCrash as e:
            self._answer_error(env, e)
            self._count_error(env.name, e)
            raise
        except Exception as e:
            self._answer_error(env, e)
            self._count_error(env.name, e)
            if env.future is None and not isinstance(e, DeepxError):
                log.exception("%s: message '%s' failed", self.name, env.name)
        else:
            if env.future is not None and not env.future.done():
                env.future.set_result(result)
        finally:
            self.stats.handled += 1
            self.stats.busy_s += time.perf_counter() - t0
            self.stats.by_message[env.name] = self.stats.by_message.get(env.name, 0) + 1

    def _answer_error(self, env: Envelope, e: BaseException) -> None:
        if env.future is not None and not env.future.done():
            env.future.set_exception(e)

    def _count_error(self, name: str, e: BaseException) -> None:
        self.stats.errors += 1
        self.stats.last_error = f"{name}: {e}"

    async def stop(self, drain: bool = True) -> None:
        """Stop after the messages already queued (drain) or now; pending asks then fail with ActorStopped."""
        if self.state in ("stopping", "stopped"):
            await self._stopped.wait()
            return
        self.state = "stopping"
        task = self._task
        if task is not None and not task.done():
            if drain:
                self.mailbox.put_nowait(_STOP)
                try:
                    await task
                except BaseException as e:  # a crash while draining: still stop
                    log.debug("%s: stopped after %r", self.name, e)
            else:
                task.cancel()
                try:
                    await task
                except BaseException as e:
                    log.debug("%s: cancelled (%r)", self.name, e)
        self._fail_pending()
        try:
            await self.on_stop()
        finally:
            self.state = "stopped"
            self._stopped.set()

    def _fail_pending(self) -> None:
        if self._held is not None:
            self.mailbox.put_nowait(self._held)
            self._held = None
        while not self.mailbox.empty():
            env = self.mailbox.get_nowait()
            if isinstance(env, Envelope) and env.future is not None and not env.future.done():
                env.future.set_exception(ActorStopped(f"actor '{self.name}' stopped before answering '{env.name}'"))

    @property
    def alive(self) -> bool:
        return self.state in ("new", "running", "crashed")


async def end_task(task: asyncio.Task[Any], timeout: float) -> None:
    """Cancel an actor's background loop and wait for it, at most `timeout` seconds: redis-py sometimes takes a
    cancellation inside a command for a lost connection and retries (a daemon stopped just after it started hung
    until it was killed), so each loop also ends when its actor is no longer alive, and a stop never waits longer."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        log.warning("%s did not end within %.0f s of its actor's stop; going on without it", task.get_name(), timeout)
        return
    if not task.cancelled() and task.exception() is not None:
        log.debug("%s ended with %r", task.get_name(), task.exception())


class ActorRef(Generic[A]):
    """How everyone else reaches an actor of type A: `tell` (fire and forget), `await ask` (a reply of the message's
    type, or an error), and `now`, the embedded daemon's way to an answer on the caller's thread."""

    __slots__ = ("_actor",)

    def __init__(self, actor: A) -> None:
        self._actor = actor

    @property
    def name(self) -> str:
        return self._actor.name

    def tell(self, message: Message[A, Any]) -> None:
        a = self._actor
        if not a.alive:
            raise ActorStopped(f"actor '{a.name}' is {a.state}; cannot tell '{message.message}'")
        a.mailbox.put_nowait(Envelope(message, None))
        a.message_waiting()

    def ask_future(self, message: Message[A, R]) -> asyncio.Future[R]:
        a = self._actor
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        if not a.alive:
            fut.set_exception(ActorStopped(f"actor '{a.name}' is {a.state}; cannot ask '{message.message}'"))
        else:
            a.mailbox.put_nowait(Envelope(message, fut))
            a.message_waiting()
        return fut

    def now(self, message: Message[A, R]) -> R | None:
        """The actor's answer to `message` made on the caller's thread, with no mailbox and no event loop step, where
        the actor offers one (a method `now_<message>`, taking the fields as `on_<message>` does) and can give it now;
        None, with nothing run, where it cannot: the caller asks instead. The embedded daemon's fast path, used while
        the caller borrows the actors' loop (deepx_sdk/loopthread.py); the only way past the mailbox."""
        name = _NOW.get(message.message)
        if name is None:
            name = _NOW[message.message] = f"now_{message.message}"
        fn = getattr(self._actor, name, None)
        return None if fn is None else fn(*message.args())  # type: ignore[no-any-return]

    async def ask(self, message: Message[A, R], timeout: float | None = None) -> R:
        a = self._actor
        if timeout is None and a.idle():
            return await a._direct(message.message, message.args())  # type: ignore[no-any-return]
        fut = self.ask_future(message)
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise DeepxError(f"actor '{self.name}' did not answer '{message.message}' within {timeout} s") from None


@dataclass
class RestartPolicy:
    max_restarts: int = 3
    window: float = 60.0


class Supervisor:
    """Starts actors and restarts the ones that crash, within a policy; stops them in reverse start order."""

    def __init__(self, policy: RestartPolicy | None = None,
                 on_give_up: Callable[[Actor, BaseException], Awaitable[None] | None] | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self.actors: dict[str, Actor] = {}
        self._restarts: dict[str, deque[float]] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._on_give_up = on_give_up

    def start(self, actor: A) -> ActorRef[A]:
        if actor.name in self.actors:
            raise DeepxError(f"an actor named '{actor.name}' is already supervised")
        self.actors[actor.name] = actor
        self._restarts[actor.name] = deque()
        actor.start()
        self._watchers[actor.name] = asyncio.get_running_loop().create_task(self._watch(actor))
        return actor.ref

    async def _watch(self, actor: Actor) -> None:
        while True:
            assert actor._task is not None
            try:
                await asyncio.shield(actor._task)
                return  # stopped normally
            except asyncio.CancelledError:
                if actor._task.cancelled():
                    return
                raise
            except BaseException as exc:
                if actor.state in ("stopping", "stopped"):
                    return
                if not await self._restart(actor, exc):
                    return

    async def _restart(self, actor: Actor, exc: BaseException) -> bool:
        now = time.monotonic()
        history = self._restarts[actor.name]
        while history and now - history[0] > self.policy.window:
            history.popleft()
        if len(history) >= self.policy.max_restarts:
            log.error("actor '%s' crashed (%s) %d times within %.0f s: giving up, stopping it",
                      actor.name, exc, len(history) + 1, self.policy.window)
            actor.state = "crashed"
            await actor.stop(drain=False)
            if self._on_give_up is not None:
                res = self._on_give_up(actor, exc)
                if inspect.isawaitable(res):
                    await res
            return False
        history.append(now)
        actor.stats.restarts += 1
        actor.state = "crashed"
        log.warning("actor '%s' crashed (%s: %s); restarting it (restart %d of at most %d per %.0f s)",
                    actor.name, type(exc).__name__, exc, len(history), self.policy.max_restarts, self.policy.window)
        try:
            await actor.on_failure(exc)
        except Exception:
            log.exception("actor '%s': on_failure raised", actor.name)
        actor._task = asyncio.get_running_loop().create_task(actor._run(), name=f"actor:{actor.name}")
        return True

    async def stop_all(self, drain: bool = True) -> None:
        for name in reversed(list(self.actors)):
            actor = self.actors[name]
            await actor.stop(drain=drain)
            w = self._watchers.pop(name, None)
            if w is not None:
                w.cancel()
                try:
                    await w
                except BaseException as e:
                    log.debug("watcher of %s ended with %r", name, e)
