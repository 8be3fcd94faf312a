"""Stored graphs as a node serves them to every client, native or embedded: store a `dx.compile` record in the
plane (`graph:<name>`), read it, drop its plan, remove it, replay it, explain it. The scheduler plans and replays;
this is the part that reads and writes the plane around it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepx_core.errors import DeepxError
from deepx_core.graphrecord import GraphRecord, check_graph_name
from deepxd.actors.messages import DropGraph, ExplainGraph, Replay, StoreGraph
from deepxd.actors.worker import RunResult

if TYPE_CHECKING:
    from deepxd.node import Node


async def graph_store(node: Node, name: Any, data: Any) -> dict[str, Any]:
    """Store a graph (dx.compile's record) as `graph:<name>` in the plane, and have the scheduler plan it."""
    check_graph_name(name)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DeepxError("graph_store: 'data' must be the graph's msgpack bytes")
    data = bytes(data)
    GraphRecord.unpack(data, name)  # refuse what would not replay before it is stored
    assert node.kv is not None
    await node.kv.set(f"graph:{name}", data)
    return dict(await node.ref("scheduler").ask(StoreGraph(name=name, data=data)))


async def graph_get(node: Node, name: Any) -> bytes | None:
    """A stored graph's bytes, None when there is none."""
    check_graph_name(name)
    assert node.kv is not None
    return await node.kv.get(f"graph:{name}")


async def graph_drop(node: Node, name: Any) -> dict[str, Any]:
    """Let go of a stored graph's plan and the temporaries its replays keep allocated on the worker (the stored
    record stays in the plane: a later replay by name plans it again)."""
    check_graph_name(name)
    return dict(await node.ref("scheduler").ask(DropGraph(name=name)))


async def graph_remove(node: Node, name: Any) -> dict[str, Any]:
    """Delete a stored graph's record (`graph:<name>`) from the plane, and let go of this node's plan of it (another
    node sharing the plane keeps its plan until its graph is dropped there: graph_drop)."""
    check_graph_name(name)
    assert node.kv is not None
    if not await node.kv.delete(f"graph:{name}"):
        raise DeepxError(f"graphs rm: no graph named {name!r} in the storage plane (`deepxctl graphs ls` lists them)")
    dropped = await graph_drop(node, name) if "scheduler" in node.refs else {}
    return {"name": name, "deleted": True, "plan_dropped": bool(dropped.get("planned")),
            "temporaries_deleted": int(dropped.get("deleted", 0))}


async def replay_graph(node: Node, name: Any, **req: Any) -> RunResult:
    """Replay a stored graph; the scheduler plans it from the plane the first time (after a restart, say)."""
    sched = node.ref("scheduler")
    result = await sched.ask(Replay(name=name, **req))
    if result is None:
        data = await graph_get(node, name)
        if data is None:
            raise DeepxError(f"replay: no graph named {name!r} in the storage plane (`deepxctl graphs ls` lists them)")
        result = await sched.ask(Replay(name=name, data=data, **req))
        assert result is not None  # (planned from the data given)
    return result


async def explain_graph(node: Node, graph: Any) -> dict[str, Any]:
    """A stored graph before and after the passes (the plan its replays run)."""
    data = await graph_get(node, graph)
    if data is None:
        raise DeepxError(f"explain: no graph named {graph!r} in the storage plane (`deepxctl graphs ls` lists them)")
    shown = await node.ref("scheduler").ask(ExplainGraph(name=graph, data=data))
    assert shown is not None  # (planned from the data given)
    return shown
