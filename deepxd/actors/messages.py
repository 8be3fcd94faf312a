"""Every actor's messages: one dataclass per message, grouped by the actor that answers it.

A message `M(Message[A, R])` goes to an actor of type A (`ActorRef[A]`), and `await ref.ask(M(...))` returns R. Its
`message` names the actor's handler `on_<message>` (and `now_<message>`, where the actor answers it on the caller's
thread: `ref.now(M(...))`), whose arguments are its fields, in order; `tests/actors/test_messages.py` holds each
to its handlers. The module
imports no actor: callers, transports and the SDK's embedded door import it cheaply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from deepx_core.ir.instr import Instr
from deepxd.actors.base import Message

if TYPE_CHECKING:  # (the names in quotes below are these: type arguments, which ruff does not read as uses)
    import numpy as np  # noqa: F401

    from deepx_core.ir.ops import TensorMeta  # noqa: F401
    from deepxd.actors.heapmem import HeapMemory  # noqa: F401
    from deepxd.actors.opcuda import CudaWorker, DeviceBlock  # noqa: F401
    from deepxd.actors.plan import Plan
    from deepxd.actors.registry import Registry
    from deepxd.actors.scheduler import Scheduler  # noqa: F401
    from deepxd.actors.worker import OpWorker, RunResult  # noqa: F401
    from deepxd.peers import Far

Rows = list[dict[str, Any]]
Fields = dict[str, Any]


# ---------------------------------------------------------------- scheduler (deepxd/actors/scheduler.py)


@dataclass(slots=True)
class Run(Message["Scheduler", "RunResult"]):
    """Run a program (its backward instructions expanded, by its plan); `origin` "udp": a UDP sender's."""

    message: ClassVar[str] = "run"
    program: Sequence[Instr]
    fetch: Sequence[str] = ()
    backwards: Sequence[dict[str, Any]] | None = None
    cancel: Callable[[], bool] | None = None
    origin: str = ""


@dataclass(slots=True)
class Explain(Message["Scheduler", Fields]):
    """A program's text before and after the passes."""

    message: ClassVar[str] = "explain"
    program: Sequence[Instr]
    fetch: Sequence[str] = ()


@dataclass(slots=True)
class Backward(Message["Scheduler", Fields]):
    """Derive and run the backward program of a recorded forward graph: {grads, instructions[, program]}."""

    message: ClassVar[str] = "backward"
    forward: Sequence[Instr]
    loss: str
    wrt: Sequence[str]
    grad_loss: str | None = None
    prefix: str = "g_"
    capture: bool = False
    names: dict[str, str] | None = None


@dataclass(slots=True)
class StoreGraph(Message["Scheduler", Fields]):
    message: ClassVar[str] = "store_graph"
    name: str
    data: bytes


@dataclass(slots=True)
class DropGraph(Message["Scheduler", Fields]):
    message: ClassVar[str] = "drop_graph"
    name: str


@dataclass(slots=True)
class GraphRecords(Message["Scheduler", "dict[str, bytes]"]):
    message: ClassVar[str] = "graph_records"


@dataclass(slots=True)
class ExplainGraph(Message["Scheduler", "Fields | None"]):
    message: ClassVar[str] = "explain_graph"
    name: str
    data: bytes | None = None


@dataclass(slots=True)
class Replay(Message["Scheduler", "RunResult | None"]):
    """Run a stored graph with its inputs, outputs and scalars bound (None: not planned here and no data came)."""

    message: ClassVar[str] = "replay"
    name: str
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    scalars: dict[str, Any] | None = None
    fetch: Sequence[str] = ()
    data: bytes | None = None


@dataclass(slots=True)
class SchedulerStats(Message["Scheduler", "dict[str, float]"]):
    message: ClassVar[str] = "stats"


# ---------------------------------------------------------------- op workers (worker.py, opcpu.py, opcuda.py)


@dataclass(slots=True)
class RunProgram(Message["OpWorker", "RunResult"]):
    """Run a program once, checked whole first; nothing of it is kept."""

    message: ClassVar[str] = "run"
    program: Sequence[Instr]
    fetch: Sequence[str] = ()
    cancel: Callable[[], bool] | None = None


@dataclass(slots=True)
class RunPlan(Message["OpWorker", "RunResult | None"]):
    """Run a plan (deepxd/actors/plan.py); None, with nothing run, where it does not stand."""

    message: ClassVar[str] = "run_plan"
    plan: Plan
    cancel: Callable[[], bool] | None = None


@dataclass(slots=True)
class Stands(Message["OpWorker", bool]):
    """`ref.now` only: whether the worker would run this plan inline now (nothing runs)."""

    message: ClassVar[str] = "stands"
    plan: Plan


@dataclass(slots=True)
class Interleaves(Message["OpWorker", bool]):
    """`ref.now` only: whether a small program naming these tensors would run before the long one running ends."""

    message: ClassVar[str] = "interleaves"
    names: AbstractSet[str]


@dataclass(slots=True)
class Fetch(Message["OpWorker", "dict[str, np.ndarray]"]):
    message: ClassVar[str] = "fetch"
    names: Sequence[str]


@dataclass(slots=True)
class Put(Message["OpWorker", Fields]):
    message: ClassVar[str] = "put"
    name: str
    dtype: str
    shape: Sequence[int]
    data: bytes | bytearray | memoryview
    heap: bool = False
    owner: str = ""


@dataclass(slots=True)
class AttachHeap(Message["OpWorker", Fields]):
    message: ClassVar[str] = "attach_heap"
    name: str
    hold: bool = True


@dataclass(slots=True)
class WorkerTensors(Message["OpWorker", Rows]):
    message: ClassVar[str] = "tensors"


@dataclass(slots=True)
class Metas(Message["OpWorker", "dict[str, TensorMeta]"]):
    message: ClassVar[str] = "metas"
    names: Sequence[str]


@dataclass(slots=True)
class Variables(Message["OpWorker", Fields]):
    message: ClassVar[str] = "variables"


@dataclass(slots=True)
class State(Message["OpWorker", "tuple[dict[str, TensorMeta], list[str], int]"]):
    """Every tensor's meta, the heap tensors' names, and the version of both."""

    message: ClassVar[str] = "state"


@dataclass(slots=True)
class OpStats(Message["OpWorker", "dict[str, dict[str, float]]"]):
    message: ClassVar[str] = "op_stats"


@dataclass(slots=True)
class HeapGone(Message["OpWorker", None]):
    message: ClassVar[str] = "heap_gone"
    name: str


@dataclass(slots=True)
class HeapFree(Message["CudaWorker", None]):
    message: ClassVar[str] = "heap_free"
    block: DeviceBlock


@dataclass(slots=True)
class Sync(Message["CudaWorker", None]):
    message: ClassVar[str] = "sync"


@dataclass(slots=True)
class Tf32(Message["CudaWorker", bool]):
    message: ClassVar[str] = "tf32"
    on: bool


@dataclass(slots=True)
class Kernels(Message["CudaWorker", "list[str]"]):
    message: ClassVar[str] = "kernels"


@dataclass(slots=True)
class DeviceInfo(Message["CudaWorker", Fields]):
    """The worker's GPU as a process group needs it: device, PCI bus id, whether NCCL loads (deepxd/groups.py)."""

    message: ClassVar[str] = "device_info"


# ---------------------------------------------------------------- heapmem (deepxd/actors/heapmem.py)


@dataclass(slots=True)
class Create(Message["HeapMemory", Fields]):
    message: ClassVar[str] = "create"
    name: str
    shape: Sequence[int]
    dtype: str
    owner: str = ""
    zero: bool = True
    replace_lost: bool = False
    device: str = ""  # the asking worker's (cuda:N): a GPU heap tensor goes on that GPU; "": heapmem's first


@dataclass(slots=True)
class Attach(Message["HeapMemory", Fields]):
    message: ClassVar[str] = "attach"
    name: str
    holder: str


@dataclass(slots=True)
class Release(Message["HeapMemory", int]):
    message: ClassVar[str] = "release"
    name: str
    holder: str


@dataclass(slots=True)
class HeapDelete(Message["HeapMemory", None]):
    message: ClassVar[str] = "delete"
    name: str
    force: bool = False


@dataclass(slots=True)
class ArrayOf(Message["HeapMemory", Any]):
    """The heap tensor's array (a view of its shared memory, or a device array)."""

    message: ClassVar[str] = "array"
    name: str
    device: str = ""  # the asking worker's (cuda:N): a tensor in another GPU's memory is refused


@dataclass(slots=True)
class Remote(Message["HeapMemory", "tuple[dict[str, np.ndarray], list[Far]]"]):
    """Other nodes' heap tensors among `names`: the views of those mapped here, the records of the rest."""

    message: ClassVar[str] = "remote"
    names: Sequence[str]


@dataclass(slots=True)
class Map(Message["HeapMemory", "np.ndarray"]):
    """Map another node's heap tensor of this host, its hold recorded by its owner first (Peers.reach)."""

    message: ClassVar[str] = "map"
    far: Far


@dataclass(slots=True)
class Hold(Message["HeapMemory", Fields]):
    """A node of this host is about to map heap tensor `name`: its hold, recorded now (a peer's `peer_hold`)."""

    message: ClassVar[str] = "hold"
    name: str
    holder: str
    handle: str
    ctime: str


@dataclass(slots=True)
class Read(Message["HeapMemory", memoryview]):
    """Bytes [offset, offset + length) of heap tensor `name`, in place (a peer's `peer_read`)."""

    message: ClassVar[str] = "read"
    name: str
    handle: str
    ctime: str
    offset: int
    length: int


@dataclass(slots=True)
class ReleaseDead(Message["HeapMemory", int]):
    """Release the holds that dead nodes took on this node's tensors: how many."""

    message: ClassVar[str] = "release_dead"


@dataclass(slots=True)
class Mapped(Message["HeapMemory", "str | None"]):
    message: ClassVar[str] = "mapped"
    name: str


@dataclass(slots=True)
class Unmap(Message["HeapMemory", bool]):
    message: ClassVar[str] = "unmap"
    name: str


@dataclass(slots=True)
class ForgetRemote(Message["HeapMemory", int]):
    message: ClassVar[str] = "forget_remote"
    names: Sequence[str]


@dataclass(slots=True)
class CheckRemote(Message["HeapMemory", None]):
    message: ClassVar[str] = "check_remote"


@dataclass(slots=True)
class Info(Message["HeapMemory", "Fields | None"]):
    message: ClassVar[str] = "info"
    name: str
    missing_ok: bool = False


@dataclass(slots=True)
class HeapList(Message["HeapMemory", Rows]):
    message: ClassVar[str] = "list"


@dataclass(slots=True)
class HeapStats(Message["HeapMemory", Fields]):
    message: ClassVar[str] = "stats"


@dataclass(slots=True)
class Lifecycle(Message["HeapMemory", int]):
    message: ClassVar[str] = "lifecycle"
    commands: Sequence[bytes] = ()
    mine: Sequence[bytes] = ()


@dataclass(slots=True)
class Republish(Message["HeapMemory", int]):
    message: ClassVar[str] = "republish"
    whole: bool = True  # every record of this node's tensors; else one of them, the whole only where it is gone


@dataclass(slots=True)
class Relabel(Message["HeapMemory", int]):
    message: ClassVar[str] = "relabel"
    names: Sequence[str]


@dataclass(slots=True)
class Adopted(Message["HeapMemory", Rows]):
    message: ClassVar[str] = "adopted"


# ---------------------------------------------------------------- registry (deepxd/actors/registry.py)


@dataclass(slots=True)
class Flush(Message["Registry", None]):
    message: ClassVar[str] = "flush"


@dataclass(slots=True)
class ListTensors(Message["Registry", Rows]):
    message: ClassVar[str] = "tensors"
    prefix: str = ""  # only names that start so (the plane matches them: no record of another name is read)


@dataclass(slots=True)
class ListOps(Message["Registry", Rows]):
    message: ClassVar[str] = "ops"


@dataclass(slots=True)
class ListCaches(Message["Registry", Rows]):
    message: ClassVar[str] = "caches"


@dataclass(slots=True)
class ListNodes(Message["Registry", Rows]):
    message: ClassVar[str] = "nodes"


@dataclass(slots=True)
class ListActors(Message["Registry", Rows]):
    message: ClassVar[str] = "actors"


@dataclass(slots=True)
class ListExecutors(Message["Registry", Rows]):
    message: ClassVar[str] = "executors"


@dataclass(slots=True)
class Memory(Message["Registry", Fields]):
    message: ClassVar[str] = "memory"


@dataclass(slots=True)
class ListGraphs(Message["Registry", Rows]):
    message: ClassVar[str] = "graphs"


@dataclass(slots=True)
class DeleteTensor(Message["Registry", Fields]):
    message: ClassVar[str] = "delete"
    name: str
    force: bool = False


#: the registry's queries by the name a client asks (the native `admin` request, deepxctl)
ADMIN: dict[str, Callable[[], Message[Registry, Any]]] = {
    m.message: m for m in (ListTensors, ListOps, ListNodes, ListActors, ListExecutors, ListCaches, Memory, ListGraphs)}

#: every message an actor of any role may be sent (the shape of a test that holds them to their handlers)
ALL: tuple[type[Message[Any, Any]], ...] = (
    Run, Explain, Backward, StoreGraph, DropGraph, GraphRecords, ExplainGraph, Replay, SchedulerStats,
    RunProgram, RunPlan, Stands, Interleaves, Fetch, Put, AttachHeap, WorkerTensors, Metas, Variables, State, OpStats,
    HeapGone, HeapFree, Sync, Tf32, Kernels, DeviceInfo,
    Create, Attach, Release, HeapDelete, ArrayOf, Remote, Map, Hold, Read, ReleaseDead, Mapped, Unmap, ForgetRemote,
    CheckRemote, Info, HeapList, HeapStats, Lifecycle, Republish, Relabel, Adopted,
    Flush, ListTensors, ListOps, ListCaches, ListNodes, ListActors, ListExecutors, Memory, ListGraphs, DeleteTensor)
