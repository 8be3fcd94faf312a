"""torch.distributed.nn.functional: collectives that autograd differentiates (docs/distributed.md).

    import deepx_sdk.distributed.nn.functional as distF
    y = distF.all_reduce(x)          # a new tensor: the ranks' x summed; y.backward() gives x the sum of their
                                     # gradients, as every rank's loss took every rank's x

Unlike deepx_sdk.distributed's collectives (in place, outside autograd, run when called), these return new tensors
and go into the rank's program like any op: the daemon's autograd differentiates them (allreduce by allreduce,
allgather by reducescatter and back) and dx.compile captures them. They need a group whose collectives are
instructions (a deepxd per rank); a failure is raised where the program is sent, as any op's.
"""

from __future__ import annotations

from typing import Any

from deepx_core.collectives import IR_OPS, ReduceOp, check_reduce
from deepx_core.ir.instr import Param
from deepx_sdk import distributed as dist
from deepx_sdk.tensor import Tensor, _tp

__all__ = ["all_gather", "all_reduce", "reduce_scatter"]


def _group(group: dist.ProcessGroup | None, what: str) -> dist.ProcessGroup:
    g = dist._begin(group, what)
    if not g.instructions:
        raise dist.DistError(f"distributed.nn.functional.{what}: process group {g.name!r} runs its collectives as "
                             "requests (its ranks share a deepxd), which autograd cannot see; give each rank a deepxd "
                             "of its own (docs/distributed.md)")
    g.usable(what)
    return g


def all_reduce(tensor: Tensor, op: Any = ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> Tensor:
    """The ranks' `tensor` reduced (SUM or AVG are differentiable), as a new tensor on every rank."""
    g = _group(group, "all_reduce")
    reduce = ReduceOp.of(op)
    check_reduce(reduce, tensor.dtype)
    return tensor._op("allreduce", (_tp(tensor), Param.var(IR_OPS[reduce]), Param.var(g.name)), tensor.shape,
                      tensor.dtype, [tensor])


def all_gather(tensor: Tensor, group: dist.ProcessGroup | None = None) -> tuple[Tensor, ...]:
    """Every rank's `tensor`, in rank order (one tensor each, as torch's)."""
    g = _group(group, "all_gather")
    one = tensor.reshape(1, *tensor.shape)
    joined = one._op("allgather", (_tp(one), Param.var(g.world_size), Param.var(g.name)),
                     (g.world_size, *tensor.shape), tensor.dtype, [one])
    return tuple(joined[r] for r in range(g.world_size))


def reduce_scatter(output: Tensor, input_list: list[Tensor], op: Any = ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None) -> Tensor:
    """input_list[r] (one tensor per rank, each shaped like `output`) reduced over the ranks, on rank r, as a new
    tensor (`output` gives its shape, as torch's)."""
    from deepx_sdk.tensor import stack

    g = _group(group, "reduce_scatter")
    reduce = ReduceOp.of(op)
    check_reduce(reduce, output.dtype)
    if len(input_list) != g.world_size:
        raise dist.DistError(f"reduce_scatter: input_list has {len(input_list)} tensors; the group has "
                             f"{g.world_size} ranks")
    dist._same("reduce_scatter", input_list, output)
    joined = stack(list(input_list))
    mine = joined._op("reducescatter", (_tp(joined), Param.var(g.world_size), Param.var(IR_OPS[reduce]),
                                        Param.var(g.name)), (1, *output.shape), output.dtype, [joined])
    return mine.reshape(output.shape)
