"""Every actor's messages (deepxd/actors/messages.py) against its handlers: each message's fields are, in order, the
arguments of the handler it names (`on_<message>`, and `now_<message>` where there is one), and every handler of an
actor has its message, so that `ref.ask(message)` can call it with the fields as they are."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, ForwardRef, get_args

import pytest

from deepxd.actors import messages
from deepxd.actors.base import Actor, Message
from deepxd.actors.heapmem import HeapMemory
from deepxd.actors.opcpu import CpuWorker
from deepxd.actors.opcuda import CudaWorker
from deepxd.actors.registry import Registry
from deepxd.actors.scheduler import Scheduler

#: the actor classes a message's type argument names
ACTORS: dict[str, list[type[Actor]]] = {"Scheduler": [Scheduler], "OpWorker": [CpuWorker, CudaWorker],
                                        "CudaWorker": [CudaWorker], "HeapMemory": [HeapMemory],
                                        "Registry": [Registry]}
LIFECYCLE = {"on_start", "on_stop", "on_failure"}


def _target(m: type[Message[Any, Any]]) -> str:
    arg = get_args(m.__orig_bases__[0])[0]  # type: ignore[attr-defined]
    return arg.__forward_arg__ if isinstance(arg, ForwardRef) else str(arg)


def _params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]


@pytest.mark.parametrize("m", messages.ALL, ids=lambda m: m.__name__)
def test_a_message_is_its_handlers_arguments_in_order(m: type[Message[Any, Any]]) -> None:
    fields = [(f.name, f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty)
              for f in dataclasses.fields(m)]  # type: ignore[arg-type]
    for actor in ACTORS[_target(m)]:
        handlers = [h for h in (getattr(actor, f"on_{m.message}", None), getattr(actor, f"now_{m.message}", None))
                    if h is not None]
        assert handlers, f"{actor.__name__} has no handler for {m.__name__} ('{m.message}')"
        for h in handlers:
            assert [n for n, _ in _params(h)] == [n for n, _ in fields], (actor.__name__, h.__name__)
            for (name, want), (_, have) in zip(fields, _params(h)):  # a default where the handler has one
                assert want == have or (want is inspect.Parameter.empty) == (have is inspect.Parameter.empty), \
                    (actor.__name__, h.__name__, name)


@pytest.mark.parametrize("actor", [Scheduler, CpuWorker, CudaWorker, HeapMemory, Registry], ids=lambda a: a.__name__)
def test_every_handler_of_an_actor_has_its_message(actor: type[Actor]) -> None:
    mine = {m.message for m in messages.ALL if actor in ACTORS[_target(m)]}
    handlers = {name[3:] for name in dir(actor) if name.startswith("on_") and name not in LIFECYCLE}
    assert handlers <= mine, sorted(handlers - mine)


async def test_an_ask_returns_the_reply_of_its_message_type() -> None:
    """A typed ask through a real worker: the reply is what the message says (RunResult, list of rows)."""
    from deepx_core.ir.text import parse_text
    from deepxd.actors.plan import Plan
    from deepxd.actors.worker import RunResult

    w = CpuWorker(output_log=False)
    ref = w.start()
    try:
        program = parse_text("newtensor (vector<int32>:[3]) -> (tensor<float32>:a)")
        r = await ref.ask(messages.RunProgram(program))
        assert isinstance(r, RunResult) and not r.error
        rows = await ref.ask(messages.WorkerTensors())
        assert [row["name"] for row in rows] == ["a"]
        plan = Plan(program, (), (), ref, program)
        assert ref.now(messages.Stands(plan)) is False  # a look with no handler for an ask: not prepared yet
    finally:
        await w.stop()
