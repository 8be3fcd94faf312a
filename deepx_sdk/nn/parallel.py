"""deepx_sdk.nn.parallel: DistributedDataParallel, as torch.nn.parallel's (docs/distributed.md).

    model = DistributedDataParallel(model)   # after dist.init_process_group(...)
    loss_fn(model(x_shard), y_shard).backward()   # the gradients come back averaged over the ranks
    opt.step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import itemsize
from deepx_sdk import distributed as dist
from deepx_sdk.nn.module import Module
from deepx_sdk.tensor import Tensor

#: torch's bucket sizes: the first bucket (the last layers' gradients, ready first) small, so that its all-reduce
#: starts early; the others bucket_cap_mb
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_CAP_MB = 25


def buckets(params: Sequence[tuple[str, Tensor]], cap_mb: float, first_bytes: int = FIRST_BUCKET_BYTES
            ) -> list[list[int]]:
    """torch's gradient buckets: the parameters (their positions) in reverse order, as the backward computes their
    gradients, one dtype to a bucket, each bucket closed once it holds its cap's bytes (the first: first_bytes)."""
    out: list[list[int]] = []
    open_: dict[str, tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i][1]
        members, size = open_.get(p.dtype, ([], 0))
        members.append(i)
        size += p.numel() * itemsize(p.dtype)
        cap = first_bytes if not out else cap_mb * (1 << 20)
        if size >= cap:
            out.append(members)
            open_.pop(p.dtype, None)
        else:
            open_[p.dtype] = (members, size)
    out.extend(members for members, _ in open_.values())
    return [b for b in out if b]


class DistributedDataParallel(Module):
    """Wraps `module` for data-parallel training: its parameters and buffers take rank 0's values when it is wrapped,
    and each backward's gradients are averaged over the ranks, in place in each parameter's `.grad` (so that every
    rank's optimizer takes the same step). Where the group's collectives are instructions (a deepxd per rank), the
    gradients go in buckets of about `bucket_cap_mb` (torch's), each an all-reduce in the step's program that the
    daemon starts as soon as the backward has computed the bucket's gradients, while it computes the rest; else all of
    a step's at one barrier after the backward. Inside `no_sync()` gradients only accumulate locally; the first
    backward after it averages what accumulated.

    As torch's with find_unused_parameters=False: every parameter that requires grad must get a gradient in each
    backward. Arguments that place the model on devices (device_ids, output_device) are accepted and change
    nothing: the daemon places tensors (docs/distributed.md)."""

    def __init__(self, module: Module, device_ids: Any = None, output_device: Any = None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: Any = None, find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False) -> None:
        super().__init__()
        if find_unused_parameters:
            raise DeepxError("DistributedDataParallel(find_unused_parameters=True) is not supported yet: every "
                             "parameter that requires grad must get a gradient in each backward (freeze the others "
                             "with requires_grad_(False))")
        self.module = module
        object.__setattr__(self, "process_group", dist._default(process_group, "DistributedDataParallel"))
        object.__setattr__(self, "broadcast_buffers", broadcast_buffers)
        object.__setattr__(self, "require_backward_grad_sync", True)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        object.__setattr__(self, "_named", named)
        cap = BUCKET_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb)
        if cap <= 0:
            raise DeepxError(f"DistributedDataParallel: bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        object.__setattr__(self, "bucket_bytes_cap", int(cap * (1 << 20)))
        object.__setattr__(self, "_buckets", buckets(named, cap))
        object.__setattr__(self, "_ready", {})  # id(parameter) -> None: gradients accumulated in this backward
        group = self.process_group
        dist.broadcast_coalesced([*module.parameters(), *module.buffers()], 0, group)
        object.__setattr__(self, "_handles", [p.register_post_accumulate_grad_hook(self._grad_ready)
                                              for _, p in named])

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._ready:
            missing = [n for n, p in self._named if id(p) not in self._ready]
            self._ready.clear()
            raise DeepxError("DistributedDataParallel: the last backward gave no gradient to "
                             f"{', '.join(missing)}, so its gradients were not averaged over the ranks; every "
                             "parameter that requires grad must take part in the loss (or set requires_grad_(False) "
                             "on those that do not)")
        if self.broadcast_buffers and self.process_group.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:  # (as instructions: in the step's program, not sent on their own)
                dist.broadcast_coalesced(buffers, 0, self.process_group, async_op=True)
        return self.module(*inputs, **kwargs)

    def _grad_ready(self, p: Tensor) -> None:
        if not self.require_backward_grad_sync:
            return
        self._ready[id(p)] = None
        if len(self._ready) < len(self._named):
            return
        self._ready.clear()
        group = self.process_group
        if group.world_size == 1:
            return
        if group.instructions:  # into the step's program, bucket by bucket (the daemon starts each when it can)
            for k, members in enumerate(self._buckets):
                grads = [g for g in (self._named[i][1].grad for i in members) if g is not None]
                if grads:
                    dist.all_reduce_coalesced(grads, dist.ReduceOp.AVG, group, async_op=True, bucket=k)
        else:
            grads = [p.grad for _, p in self._named]
            dist.all_reduce_coalesced([g for g in grads if g is not None], dist.ReduceOp.AVG, group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients on this rank only (no collective); the first backward after it
        averages the accumulated gradients over the ranks."""
        before = self.require_backward_grad_sync
        object.__setattr__(self, "require_backward_grad_sync", False)
        try:
            yield
        finally:
            object.__setattr__(self, "require_backward_grad_sync", before)


__all__ = ["DistributedDataParallel"]
