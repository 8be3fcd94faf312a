"""A node serves only once its actors have started: Node._until_started waits for every actor's first on_start,
whether it returns or raises, and says in the log what it still waits for."""

from __future__ import annotations

import asyncio
import logging

import pytest

import deepxd.node as node_module
from deepxd.actors.base import Actor
from deepxd.config import Config
from deepxd.node import Node


class Starting(Actor):
    role = "starting"

    def __init__(self, name: str, gate: asyncio.Event, fail: BaseException | None = None) -> None:
        super().__init__(name)
        self.gate, self.fail = gate, fail

    async def on_start(self) -> None:
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail


async def test_the_wait_ends_with_the_slowest_start_and_says_what_it_waits_for(monkeypatch, caplog):
    monkeypatch.setattr(node_module, "STARTING_LOG_S", 0.05)
    node = Node(Config())
    slow, quick = asyncio.Event(), asyncio.Event()
    quick.set()
    node.supervisor.start(Starting("quick", quick))
    node.supervisor.start(Starting("slow-recovery", slow))
    waiting = asyncio.ensure_future(node._until_started())
    with caplog.at_level(logging.INFO, logger="deepxd.node"):
        await asyncio.sleep(0.3)
        assert not waiting.done()
        assert "still starting after 0 s: slow-recovery" in caplog.text and "quick" not in caplog.text
        slow.set()
        await asyncio.wait_for(waiting, 5)
    assert {a.name: a.state for a in node.supervisor.actors.values()} == {"quick": "running",
                                                                          "slow-recovery": "running"}
    await node.supervisor.stop_all()


@pytest.mark.parametrize("fail", [RuntimeError("plane unreadable"), asyncio.CancelledError()],
                         ids=["raises", "cancelled"])
async def test_a_start_that_fails_ends_the_wait(fail):
    """A failed start is its supervisor's (restarted, or given up on); it must not hold the node's start for good
    (a CancelledError from on_start, its task not cancelled, left the actor 'new' with no restart)."""
    node = Node(Config())
    gate = asyncio.Event()
    gate.set()
    node.supervisor.start(Starting("failing", gate, fail))
    await asyncio.wait_for(node._until_started(), 5)
    await node.supervisor.stop_all(drain=False)
