"""The one door from the SDK into a deepxd node that runs inside the SDK's own process (`dx.connect()` with no
address): the node is built from the settings an embedded session needs, and every request the SDK makes of it goes
through this class, as a socket client's goes through the native protocol (deepxd/net/native.py).

Each request is a coroutine for the node's event loop; `now_run` and `now_replay` answer a repeated program or graph
on the caller's thread while the caller borrows that loop (deepx_sdk/loopthread.py), and answer None where the
request must take the coroutine instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.identity import this_process
from deepx_core.ir.dtypes import from_numpy
from deepx_core.ir.instr import Instr
from deepxd import groups
from deepxd.actors.messages import Backward, ListGraphs, Put, Relabel, Replay, Run
from deepxd.actors.worker import RunResult
from deepxd.config import Config, environment_settings, with_needed_roles
from deepxd.graphstore import explain_graph, graph_drop, graph_get, graph_store, replay_graph
from deepxd.node import Node
from deepxd.owners import Session

#: the roles of an embedded node when neither the caller nor DEEPX_ROLES names them
DEFAULT_ROLES = ("registry", "heapmem", "scheduler", "op-cpu")
#: settings an embedded node takes from DEEPX_<NAME> variables, as deepxd does (the GPU's)
FROM_ENVIRONMENT = ("cuda_device", "cuda_tf32", "cuda_warm", "cuda_graphs")


class EmbeddedNode:
    """A deepxd node for one process: no UDP, a private socket for deepxctl, programs run on the event loop."""

    def __init__(self, socket_path: str, node_id: str, roles: Sequence[str] | None = None, *, blas: str = "auto",
                 native_kernels: bool = True, name: str | None = None) -> None:
        # every program runs on the event loop (inline_elements -1), which the SDK's thread borrows while the loop's
        # own thread sleeps: no thread hand-off for a program the actors answer at once
        self.config = Config(listen=[f"unix://{socket_path}"], udp="off",
                             roles=with_needed_roles(list(roles or DEFAULT_ROLES)), node_id=node_id,
                             log_level="warning", inline_elements=-1, blas=blas, native_kernels=int(native_kernels),
                             **environment_settings(FROM_ENVIRONMENT))
        if self.config.cuda_device < 0:  # an embedded node drives one GPU: DEEPX_CUDA_DEVICE's, else the first
            self.config.cuda_device = 0
        self.node = Node(self.config)
        # the session that owns what the SDK makes here: this process (`name`: the program's, by default)
        me = this_process(name)
        self.session = Session(me["name"], me["pid"], me["host"])

    @property
    def address(self) -> str:
        return f"unix://{self.config.socket_path}"

    async def start(self) -> None:
        await self.node.start()

    async def shutdown(self) -> None:
        await self.node.shutdown()

    # -- programs
    def now_run(self, program: list[Instr], fetch: list[str], backwards: list[dict[str, Any]] | None) -> Any:
        """A program the scheduler has run before, answered on this thread (Scheduler.now_run), or None."""
        return self.node.ref("scheduler").now(Run(program, fetch, backwards))

    async def run(self, program: list[Instr], fetch: list[str], backwards: list[dict[str, Any]] | None
                  ) -> RunResult:
        return await self.node.ref("scheduler").ask(Run(program=program, fetch=fetch,  # type: ignore[no-any-return]
                                                    backwards=backwards))

    async def put(self, name: str, array: np.ndarray, heap: bool) -> None:
        a = np.ascontiguousarray(array)
        await self.node.worker().ask(Put(name=name, dtype=from_numpy(a.dtype), shape=list(array.shape),
                                     data=a.reshape(-1).view(np.uint8).data, heap=heap))

    async def backward(self, forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None,
                       prefix: str, names: dict[str, str] | None = None, capture: bool = False) -> dict[str, Any]:
        """The gradient program of `forward` (autograd); with capture, the program itself comes back unrun."""
        return dict(await self.node.ref("scheduler").ask(Backward(forward=list(forward), loss=loss,
                                                         wrt=list(wrt), grad_loss=grad_loss, prefix=prefix,
                                                         capture=capture, names=names)))

    async def label(self, prefix: str | None, tensors: dict[str, dict[str, str]] | None) -> None:
        """As the native `label` request: the tensors named under `prefix` are this process's session's; `tensors`
        gives their labels (a parameter's module path, the line that made it)."""
        owners = self.node.owners
        owners.label_request({"prefix": prefix, "tensors": tensors}, self.session, set())
        if tensors and "heapmem" in self.node.refs:
            await self.node.ref("heapmem").ask(Relabel(names=list(tensors)))

    # -- process groups (deepxd/groups.py)
    async def group(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        """A process-group request (`join`, `barrier`, `leave`), as the native socket's `group_<op>`."""
        handler = {"join": groups.join, "barrier": groups.barrier, "leave": groups.leave}.get(op)
        if handler is None:
            raise DeepxError(f"unknown process-group request {op!r}")
        return await handler(self.node, **fields)  # type: ignore[operator]

    # -- stored graphs (deepxd/graphstore.py)
    async def graph_store(self, name: str, data: bytes) -> dict[str, Any]:
        self.node.owners.bind(f"{name}.", self.session)  # its temporaries are named under the graph's name
        return await graph_store(self.node, name, data)

    async def graph_drop(self, name: str) -> dict[str, Any]:
        return await graph_drop(self.node, name)

    async def graph_get(self, name: str) -> bytes | None:
        return await graph_get(self.node, name)

    async def explain(self, name: str) -> dict[str, Any]:
        return await explain_graph(self.node, name)

    async def graphs(self) -> list[dict[str, Any]]:
        return list(await self.node.ref("registry").ask(ListGraphs()))

    def now_replay(self, name: str, inputs: dict[str, Any], outputs: dict[str, str], scalars: dict[str, Any],
                   fetch: list[str]) -> Any:
        """A replay answered on this thread (Scheduler.now_replay), or None."""
        return self.node.ref("scheduler").now(Replay(name, inputs, outputs, scalars, fetch))

    async def replay(self, name: str, inputs: dict[str, Any], outputs: dict[str, str], scalars: dict[str, Any],
                     fetch: list[str]) -> RunResult:
        return await replay_graph(self.node, name, inputs=inputs, outputs=outputs, scalars=scalars, fetch=fetch)
