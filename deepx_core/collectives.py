"""The collectives as deepxIR where ranks share a daemon: the reductions a rank runs over the ranks' heap tensors,
and their names; and the reductions' names in the collective instructions.

Where ranks share a daemon, a collective (deepx_sdk.distributed) is: each rank writes its contribution into a heap
tensor of its own (a buffer), the ranks meet at a barrier, and each then runs a program that reads the buffers it
needs, which the daemons map without a copy (docs/distributed.md). This module is the part of that which is only
deepxIR: what the programs are. Where each rank has a daemon, collectives are instructions of the catalogue
(allreduce, broadcast, allgather, reducescatter), run by the daemons (deepxd/comm.py).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, Param

FLOATS = frozenset({"float64", "float32", "float16", "bfloat16"})


class ReduceOp(enum.Enum):
    """How all_reduce and reduce_scatter combine the ranks' tensors, as torch.distributed.ReduceOp."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"

    @classmethod
    def of(cls, op: object) -> ReduceOp:
        """`op` as a ReduceOp: one already, or its name ("sum", "avg", "mean", "max", ...)."""
        if isinstance(op, ReduceOp):
            return op
        name = str(op).lower().rpartition(".")[2]
        try:
            return cls("avg" if name == "mean" else name)
        except ValueError:
            raise DeepxError(f"unknown reduce op {op!r}; use one of {', '.join(o.name for o in cls)}") from None


#: the elementwise op of each reduction, applied pairwise (AVG: the SUM, then divided by the number of ranks)
PAIRWISE = {ReduceOp.SUM: "add", ReduceOp.AVG: "add", ReduceOp.PRODUCT: "mul", ReduceOp.MIN: "min",
            ReduceOp.MAX: "max"}
#: each reduction as the collective instructions name it (their `op` arg: deepx_core/ir/ops.py, REDUCE_OPS)
IR_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "mean", ReduceOp.PRODUCT: "product", ReduceOp.MIN: "min",
          ReduceOp.MAX: "max"}


def check_reduce(op: ReduceOp, dtype: str) -> None:
    """Refuse a reduction a tensor of `dtype` has none of (the mean of integers)."""
    if op is ReduceOp.AVG and dtype not in FLOATS:
        raise DeepxError(f"ReduceOp.AVG of a {dtype} tensor: the mean of integers is not one; use ReduceOp.SUM")


def buffer_name(gen: str, rank: int, key: str, parity: int) -> str:
    """The heap tensor rank `rank` of formation `gen` writes its contribution to, for buffer `key` (its dtype, shape
    and slot); `parity` alternates between calls, so that a rank writes the next call's contribution while a slower
    one may still read this call's, with one barrier a call. Outside every session's names (whose release at a
    session's end would free it under the other ranks): the group frees its buffers as its ranks leave."""
    return f"dd{gen}r{rank}_{key}_{parity}"


def buffer_rank(name: str, gen: str) -> int | None:
    """The rank whose buffer `name` is, in formation `gen`; None where it is none of that formation's."""
    head, _, rest = name.partition("_")
    if not head.startswith(f"dd{gen}r") or not rest:
        return None
    rank = head[len(gen) + 3:]
    return int(rank) if rank.isdigit() else None


def buffer_key(dtype: str, shape: Sequence[int], slot: int = 0) -> str:
    return f"{dtype}_{'x'.join(map(str, shape)) or 's'}_{slot}"


def reduce_into(op: ReduceOp, sources: Sequence[str], out: str, dtype: str, world: int) -> list[Instr]:
    """Instructions that write `op` over the tensors `sources` (all of `dtype`) into `out`, which may be one of
    them; AVG divides the sum by `world`."""
    check_reduce(op, dtype)
    if not sources:
        raise DeepxError("a reduction needs at least one tensor")
    o = Param.tensor(out, dtype)
    if len(sources) == 1:
        return [] if sources[0] == out else [Instr("copytensor", (Param.tensor(sources[0], dtype),), (o,))]
    name = PAIRWISE[op]
    program = [Instr(name, (Param.tensor(sources[0], dtype), Param.tensor(sources[1], dtype)), (o,))]
    program += [Instr(name, (o, Param.tensor(s, dtype)), (o,)) for s in sources[2:]]
    if op is ReduceOp.AVG:
        program.append(Instr("divscalar", (o, Param.var(float(world), dtype)), (o,)))
    return program


def heap_buffer(name: str, dtype: str, shape: Sequence[int]) -> Instr:
    """Make heap tensor `name` (kept where it stands with this shape and dtype: buffers are made once and reused)."""
    return Instr("newtensor", (Param.vector(tuple(shape)),), (Param.tensor(name, dtype),), (("kind", "heap"),))


def copy(src: str, dst: str, dtype: str) -> Instr:
    return Instr("copytensor", (Param.tensor(src, dtype),), (Param.tensor(dst, dtype),))
