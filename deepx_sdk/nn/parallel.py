"""deepx_sdk.nn.parallel: DistributedDataParallel, as torch.nn.parallel's (docs/distributed.md).

    model = DistributedDataParallel(model)   # after dist.init_process_group(...)
    loss_fn(model(x_shard), y_shard).backward()   # the gradients come back averaged over the ranks
    opt.step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from deepx_core.errors import DeepxError
from deepx_sdk import distributed as dist
from deepx_sdk.nn.module import Module
from deepx_sdk.tensor import Tensor


class DistributedDataParallel(Module):
    """Wraps `module` for data-parallel training: its parameters and buffers take rank 0's values when it is wrapped,
    and each backward's gradients are averaged over the ranks, all of a step's at one barrier, in place in each
    parameter's `.grad` (so that every rank's optimizer takes the same step). Inside `no_sync()` gradients only
    accumulate locally; the first backward after it averages what accumulated.

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
            if buffers:
                dist.broadcast_coalesced(buffers, 0, self.process_group)
        return self.module(*inputs, **kwargs)

    def _grad_ready(self, p: Tensor) -> None:
        if not self.require_backward_grad_sync:
            return
        self._ready[id(p)] = None
        if len(self._ready) < len(self._named):
            return
        self._ready.clear()
        grads = [p.grad for _, p in self._named]
        if self.process_group.world_size > 1:
            dist.all_reduce_coalesced([g for g in grads if g is not None], dist.ReduceOp.AVG, self.process_group)

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
