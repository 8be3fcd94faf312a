"""Other nodes of this plane, as one node sees them: whether a node is alive (its `node:<id>` record's state and
heartbeat), and a request to its native socket where it runs on this host (a peer link over its Unix socket; links
to other hosts come with TCP listeners)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

from deepx_core.errors import DeepxError
from deepxd.kv.base import KV

#: a node is dead when its last heartbeat is older than this many of its heartbeats (deepxctl nodes ls: `stale`)
DEAD_HEARTBEATS = 5


def unreachable(record: dict[str, str], node: str, dead_after_s: float) -> str | None:
    """Why node `node` (its `node:<id>` record) cannot be reached now, in words that follow "node X"; None where it
    is alive."""
    if not record:
        return "is not in the storage plane"
    state = record.get("state")
    if state != "running":
        return f"is {state or 'in an unknown state'}"
    age = time.time() - float(record.get("heartbeat") or 0)
    if age > dead_after_s:
        return f"is dead (its last heartbeat was {age:.1f} s ago)"
    return None


def on_this_host(record: dict[str, str]) -> bool:
    return record.get("host", socket.gethostname()) == socket.gethostname()


async def ask_node(kv: KV, node: str, op: str, dead_after_s: float, timeout: float = 30.0,
                   **fields: Any) -> dict[str, Any]:
    """The reply of node `node` to native request `op` (DeepxError with its error, or why it cannot be reached)."""
    from deepx_core.client import NativeClient

    record = await kv.hgetall(f"node:{node}")
    why = unreachable(record, node, dead_after_s)
    if why is not None:
        raise DeepxError(f"node {node} {why}")
    if not on_this_host(record):
        raise DeepxError(f"node {node} runs on host {record.get('host')}: nodes on other hosts are reached over "
                         "peer links, which deepx does not have yet (docs/storage.md)")
    try:
        address = json.loads(record.get("addresses") or "{}").get("unix", "")
    except json.JSONDecodeError:
        address = ""
    if not address:
        raise DeepxError(f"node {node} publishes no Unix socket address in node:{node}")
    if not address.startswith("unix://"):
        address = "unix://" + address

    def call() -> dict[str, Any]:
        with NativeClient(address, timeout=timeout, client=f"deepxd peer of {node}") as c:
            return c.request(op, **fields)

    return await asyncio.to_thread(call)
