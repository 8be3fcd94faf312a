"""deepx_sdk.optim: torch.optim's SGD, Adam and AdamW, each step one fused update instruction per parameter
(the catalogue's `sgd`, `adam`, `adamw`), and the StepLR and CosineAnnealingLR schedulers."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, Param
from deepx_sdk.recorder import origin
from deepx_sdk.tensor import Tensor, _tp, zeros

__all__ = ["SGD", "Adam", "AdamW", "CosineAnnealingLR", "Optimizer", "StepLR", "lr_scheduler"]


#: the scalar params of the updates, by value: the same objects every step (cheaper to record, and a repeated
#: program then compares param by param by identity); a float's key tells -0.0 from 0.0
_VARS: Cache[tuple[Any, ...], Param] = Cache("sdk.optim_vars", 4096, counted=False)


def _var(value: bool | int | float) -> Param:
    t = type(value)
    key = (t, value, math.copysign(1.0, value)) if t is float else (t, value)
    p = _VARS.get(key)
    if p is None:
        p = _VARS.put(key, Param.var(value))
    return p


_SGD_HYPER, _SGD_KINDS = ("lr", "momentum", "dampening", "weight_decay", "nesterov"), (float,) * 4 + (bool,)
_ADAM_HYPER, _ADAM_KINDS = ("lr", "eps", "weight_decay"), (float,) * 3


class Optimizer:
    """Parameter groups, per-parameter state, zero_grad, state_dict; subclasses give `defaults` and `_update`."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        groups = list(params)
        if not groups:
            raise DeepxError(f"{type(self).__name__}: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.defaults = defaults
        self.param_groups: list[dict[str, Any]] = []
        for g in groups:
            self.add_param_group(g)
        self.state: dict[int, dict[str, Any]] = {}  # by id(param): a Tensor's == records a comparison
        # by id(group): its hyperparameters' values and their var params (_hyper); the line that called step (_at)
        self._hypers: dict[int, tuple[tuple[Any, ...], tuple[Param, ...]]] = {}
        self._at: Any = None
        self._count: tuple[dict[str, Any], int] | None = None  # (state, step before) of the update being recorded

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Another group of parameters, with its own hyperparameters (the defaults for those it does not give), as
        torch's: e.g. a layer unfrozen part-way through training."""
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise DeepxError(f"{type(self).__name__}.add_param_group: give a dict with 'params'")
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        group = {**self.defaults, **param_group, "params": params}
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for p in params:
            if not isinstance(p, Tensor):
                raise DeepxError(f"{type(self).__name__}: parameters must be tensors, got {type(p).__name__}")
            if id(p) in seen:
                raise DeepxError(f"{type(self).__name__}: parameter '{p.name}' appears in more than one group")
            seen.add(id(p))
        self.param_groups.append(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def step(self) -> None:
        """One update of every parameter that has a gradient: one instruction each."""
        # the user's line that called step, looked up once for all the updates (an error in one names it); None
        # again after, so that an update recorded by another step (a subclass's) finds its own line
        self._at = origin(sys._getframe(1))
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.shape != p.shape:
                        raise DeepxError(f"{type(self).__name__}: gradient of '{p.name}' has shape {p.grad.shape}, "
                                         f"the parameter {p.shape}")
                    state = self.state.setdefault(id(p), {"step": 0})
                    self._count = (state, state["step"])
                    state["step"] += 1
                    self._update(p, p.grad.type_as_dtype(p.dtype), state, group)
        finally:
            self._at = self._count = None

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise DeepxError(f"{type(self).__name__} defines no update")

    def _record(self, p: Tensor, instr: Instr) -> None:
        if self._count is not None:  # an update that never runs (its program failed first) is not counted
            state, before = self._count
            p._s.recorder.undo_unrun(instr, lambda: state.__setitem__("step", before))
        if self._at is None:  # not inside Optimizer.step: the line is found from the stack
            p._s.recorder.record(instr)
        else:
            p._s.recorder.record_at(instr, self._at)
        p._s.tape.wrote(p)  # a graph recorded before the update must not take the new value for the old

    def _hyper(self, group: dict[str, Any], names: tuple[str, ...], kinds: tuple[type, ...]) -> tuple[Param, ...]:
        """The var params of a group's hyperparameters, remade only when one changed (a scheduler's lr): every step
        records the same objects. Floats are told apart by sign too (-0.0 is not 0.0)."""
        values = tuple(kind(group[n]) for n, kind in zip(names, kinds))
        key = tuple((v, math.copysign(1.0, v)) if type(v) is float else v for v in values)
        made = self._hypers.get(id(group))
        if made is not None and made[0] == key:
            return made[1]
        params = tuple(_var(v) for v in values)
        self._hypers[id(group)] = (key, params)
        return params

    def _buffer(self, p: Tensor, state: dict[str, Any], key: str) -> Tensor:
        buf = state.get(key)
        if buf is None or buf.name in buf._s.names.lost:  # (made by a program that failed: it never came to exist)
            buf = state[key] = zeros(p.shape, dtype=p.dtype)
        return buf

    # -- state
    def state_dict(self) -> dict[str, Any]:
        """torch's layout: parameters by position; tensors in the state are dx Tensors."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        groups = []
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [index[id(p)] for p in g["params"]]})
        return {"state": {index[k]: dict(s) for k, s in self.state.items() if k in index}, "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        groups = sd.get("param_groups", [])
        if len(groups) != len(self.param_groups) or any(len(a["params"]) != len(b["params"])
                                                         for a, b in zip(groups, self.param_groups)):
            raise DeepxError("load_state_dict: the saved parameter groups do not match this optimizer's")
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.state = {}
        for i, s in sd.get("state", {}).items():
            p = params[int(i)]
            state: dict[str, Any] = {}
            for k, v in s.items():
                if isinstance(v, (np.ndarray, Tensor)) or hasattr(v, "numpy"):
                    from deepx_sdk.tensor import tensor

                    arr = np.asarray(v.numpy() if hasattr(v, "numpy") else v)
                    if arr.ndim == 0 and k == "step":
                        state[k] = int(arr)
                        continue
                    t = tensor(arr, dtype=p.dtype)
                    if t.shape != p.shape:
                        raise DeepxError(f"load_state_dict: state '{k}' of parameter {i} has shape {t.shape}, "
                                         f"the parameter {p.shape}")
                    state[k] = t
                elif v is not None:  # torch's SGD keeps momentum_buffer None without momentum
                    state[k] = int(v) if k == "step" else v
            if "step" not in state:  # torch's SGD keeps no count: a buffer it saved means its first step is done
                state["step"] = 1 if any(isinstance(v, Tensor) for v in state.values()) else 0
            self.state[id(p)] = state


def sgd_step(step: int) -> int:
    """The step an `sgd` instruction carries: its kernel only tells the first step (the buffer starts as the
    gradient) from the rest, so every later step sends 2 and a training loop sends the very same program each
    step, which the daemon then runs without checking it again."""
    return min(step, 2)


class SGD(Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise DeepxError(f"SGD: lr={lr}, momentum={momentum} and weight_decay={weight_decay} must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise DeepxError("SGD: nesterov needs momentum > 0 and dampening 0")
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov})

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        # without momentum the kernel never touches the buffer: the gradient stands in for it
        buf = self._buffer(p, state, "momentum_buffer") if group["momentum"] else g
        hyper = self._hyper(group, _SGD_HYPER, _SGD_KINDS)
        args = (_tp(p), _tp(g), _tp(buf), *hyper, _var(sgd_step(int(state["step"]))))
        self._record(p, Instr("sgd", args, (_tp(p), _tp(buf))))


class Adam(Optimizer):
    op = "adam"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise DeepxError(f"{type(self).__name__}: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
                             " out of range")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        m = self._buffer(p, state, "exp_avg")
        v = self._buffer(p, state, "exp_avg_sq")
        b1, b2 = group["betas"]
        lr, eps, wd = self._hyper(group, _ADAM_HYPER, _ADAM_KINDS)
        args = (_tp(p), _tp(g), _tp(m), _tp(v), lr, _var(float(b1)), _var(float(b2)), eps, wd,
                _var(int(state["step"])))
        self._record(p, Instr(self.op, args, (_tp(p), _tp(m), _tp(v))))


class AdamW(Adam):
    op = "adamw"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class _Scheduler:
    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        for g, lr in zip(optimizer.param_groups, self.base_lrs):
            g.setdefault("initial_lr", lr)
        self.last_epoch = 0
        self._last_lr = list(self.base_lrs)

    def step(self) -> None:
        self.last_epoch += 1
        for g, lr in zip(self.optimizer.param_groups, self._lrs()):
            g["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _lrs(self) -> list[float]:
        raise DeepxError(f"{type(self).__name__} defines no schedule")

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.__dict__.update(sd)


class StepLR(_Scheduler):
    """Every step_size epochs, each group's lr times gamma: base_lr * gamma ** (epoch // step_size) while nobody sets
    the lr by hand; torch's chainable form, so that an lr set in between is decayed from where it stands."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1) -> None:
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer)

    def _lrs(self) -> list[float]:
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        if self.last_epoch % self.step_size:
            return lrs
        return [lr * self.gamma for lr in lrs]


class CosineAnnealingLR(_Scheduler):
    """lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2 while nobody sets the lr by hand, in
    torch's recursive form (each step from the group's current lr), which gives torch's values to the bit and
    follows an lr set in between as torch does."""

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0) -> None:
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer)

    def _lrs(self) -> list[float]:
        t, n, low = self.last_epoch, self.T_max, self.eta_min
        groups = self.optimizer.param_groups
        if (t - 1 - n) % (2 * n) == 0:
            return [g["lr"] + (b - low) * (1 - math.cos(math.pi / n)) / 2 for b, g in zip(self.base_lrs, groups)]
        return [(1 + math.cos(math.pi * t / n)) / (1 + math.cos(math.pi * (t - 1) / n)) * (g["lr"] - low) + low
                for g in groups]


class _LRSchedulerModule:
    StepLR = StepLR
    CosineAnnealingLR = CosineAnnealingLR


lr_scheduler = _LRSchedulerModule()
