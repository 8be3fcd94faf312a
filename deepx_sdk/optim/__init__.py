"""deepx_sdk.optim: torch.optim's SGD, Adam and AdamW, each step one fused update instruction per parameter
(the catalogue's `sgd`, `adam`, `adamw`); RMSprop, written with tensor ops (the daemon's fuse pass joins them); and
the StepLR, CosineAnnealingLR, LambdaLR, LinearLR (warm-up) and OneCycleLR schedulers."""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, Param
from deepx_sdk.recorder import origin
from deepx_sdk.tensor import Tensor, _tp, zeros

__all__ = ["SGD", "Adam", "AdamW", "CosineAnnealingLR", "LambdaLR", "LinearLR", "OneCycleLR", "Optimizer", "RMSprop",
           "StepLR", "lr_scheduler"]


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


_NUMBERS = (float, int, bool)
_tuple_new = tuple.__new__  # an Instr without the named tuple's Python-level __new__ (as deepx_sdk.tensor's)
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
        # by (id(group), names): its hyperparameters' values, their key and var params (_hyper); the line that called
        # step (_at)
        self._hypers: dict[tuple[int, tuple[str, ...]], tuple[list[Any], tuple[Any, ...], tuple[Param, ...]]] = {}
        self._betas: dict[int, tuple[Any, Param, Param]] = {}  # by id(group): its betas and their var params (Adam)
        self._at: Any = None
        # the hyperparameters' params of each group, by (id(group), names), within one step (its parameters share them)
        self._this_step: dict[tuple[int, tuple[str, ...]], tuple[Param, ...]] | None = None
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
        self._this_step = {}
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.shape != p.shape:
                        raise DeepxError(f"{type(self).__name__}: gradient of '{p.name}' has shape {p.grad.shape}, "
                                         f"the parameter {p.shape}")
                    state = self.state.get(id(p))
                    if state is None:
                        state = self.state[id(p)] = {"step": 0}
                    self._count = (state, state["step"])
                    state["step"] += 1
                    g = p.grad
                    self._update(p, g if g.dtype == p.dtype else g.type_as_dtype(p.dtype), state, group)
        finally:
            self._at = self._count = self._this_step = None

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
        at = (id(group), names)
        this_step = self._this_step
        if this_step is not None:
            params = this_step.get(at)
            if params is not None:  # another parameter of the group, in this step
                return params  # type: ignore[no-any-return]
            this_step[at] = params = self._hyper_params(group, names, kinds, at)
            return params
        return self._hyper_params(group, names, kinds, at)

    def _hyper_params(self, group: dict[str, Any], names: tuple[str, ...], kinds: tuple[type, ...],
                      at: tuple[int, tuple[str, ...]]) -> tuple[Param, ...]:
        raw = [group[n] for n in names]
        made = self._hypers.get(at)
        if made is not None and all(map(operator.is_, raw, made[0])):  # the very values: the same params
            return made[2]
        values = tuple(kind(v) for v, kind in zip(raw, kinds))
        key = tuple((v, math.copysign(1.0, v)) if type(v) is float else v for v in values)
        if made is not None and made[1] == key:
            params = made[2]
        else:
            params = tuple(_var(v) for v in values)
        # (kept for the identity check only where no value can change in place: Python's numbers)
        self._hypers[at] = (raw if all(type(v) in _NUMBERS for v in raw) else [None] * len(raw), key, params)
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
        betas = group["betas"]
        made = self._betas.get(id(group))
        if made is None or made[0] is not betas:
            b1, b2 = betas
            # kept for the identity check only where the values cannot change in place: a tuple of Python numbers
            kept = betas if type(betas) is tuple and type(b1) in _NUMBERS and type(b2) in _NUMBERS else None
            made = self._betas[id(group)] = (kept, _var(float(b1)), _var(float(b2)))
        lr, eps, wd = self._hyper(group, _ADAM_HYPER, _ADAM_KINDS)
        pp, pm, pv = p._p or _tp(p), m._p or _tp(m), v._p or _tp(v)
        args = (pp, g._p or _tp(g), pm, pv, lr, made[1], made[2], eps, wd, _var(int(state["step"])))
        self._record(p, _tuple_new(Instr, (self.op, args, (pp, pm, pv), ())))


class AdamW(Adam):
    op = "adamw"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class RMSprop(Optimizer):
    """torch.optim.RMSprop: square_avg = alpha * square_avg + (1 - alpha) * g^2; p -= lr * g / (sqrt(square_avg) +
    eps), with weight decay, momentum and the centered variant as torch computes them. Each step is a few elementwise
    instructions per parameter, which the daemon's fuse pass joins."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or momentum < 0 or alpha < 0:
            raise DeepxError(f"RMSprop: lr={lr}, alpha={alpha}, eps={eps}, weight_decay={weight_decay} and "
                             f"momentum={momentum} must be >= 0")
        super().__init__(params, {"lr": lr, "alpha": alpha, "eps": eps, "weight_decay": weight_decay,
                                  "momentum": momentum, "centered": centered})

    def _update(self, p: Tensor, g: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        from deepx_sdk.grad_mode import no_grad

        lr, alpha, eps = float(group["lr"]), float(group["alpha"]), float(group["eps"])
        wd, momentum = float(group["weight_decay"]), float(group["momentum"])
        with no_grad():
            if wd:
                g = g + p * wd
            sq = self._buffer(p, state, "square_avg")
            sq.copy_(sq * alpha + g * g * (1 - alpha))
            if group["centered"]:
                ga = self._buffer(p, state, "grad_avg")
                ga.copy_(ga + (g - ga) * (1 - alpha))  # torch's lerp_(g, 1 - alpha)
                avg = (sq - ga * ga).sqrt() + eps
            else:
                avg = sq.sqrt() + eps
            if momentum > 0:
                buf = self._buffer(p, state, "momentum_buffer")
                buf.copy_(buf * momentum + g / avg)
                p.copy_(p - buf * lr)
            else:
                p.copy_(p - g / avg * lr)


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


class LambdaLR(_Scheduler):
    """lr = base_lr * lr_lambda(epoch) (one function, or one per group), set at construction for epoch 0 as torch
    does: a warm-up is `LambdaLR(opt, lambda e: min(1.0, (e + 1) / warmup))`."""

    def __init__(self, optimizer: Optimizer, lr_lambda: Any) -> None:
        super().__init__(optimizer)
        n = len(optimizer.param_groups)
        self.lr_lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * n
        if len(self.lr_lambdas) != n:
            raise DeepxError(f"LambdaLR: {len(self.lr_lambdas)} functions for {n} parameter groups")
        self._apply(self._lrs())

    def _lrs(self) -> list[float]:
        return [base * f(self.last_epoch) for f, base in zip(self.lr_lambdas, self.base_lrs)]

    def _apply(self, lrs: list[float]) -> None:
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = list(lrs)

    def state_dict(self) -> dict[str, Any]:  # functions are not state (torch keeps only callable objects' dicts)
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}


class LinearLR(_Scheduler):
    """The lr scaled by a factor going linearly from start_factor to end_factor over total_iters steps, then kept
    (torch's warm-up), in torch's chainable form: each step from the group's current lr."""

    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5) -> None:
        if not 0 < start_factor <= 1 or not 0 <= end_factor <= 1:
            raise DeepxError(f"LinearLR: start_factor={start_factor} must be in (0, 1] and end_factor={end_factor} "
                             "in [0, 1]")
        self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, total_iters
        super().__init__(optimizer)
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * start_factor
        self._last_lr = [g["lr"] for g in optimizer.param_groups]

    def _lrs(self) -> list[float]:
        groups = self.optimizer.param_groups
        if self.last_epoch > self.total_iters:
            return [g["lr"] for g in groups]
        delta = self.end_factor - self.start_factor
        return [g["lr"] * (1.0 + delta / (self.total_iters * self.start_factor + (self.last_epoch - 1) * delta))
                for g in groups]


class OneCycleLR(_Scheduler):
    """The 1cycle policy as torch computes it: the lr rises from max_lr / div_factor to max_lr over pct_start of
    total_steps, then anneals to initial_lr / final_div_factor (cosine or linear; three_phase as torch), and the
    momentum (SGD's momentum, Adam's beta1) cycles the other way between max_momentum and base_momentum. Stepped
    once per batch; a step past total_steps raises."""

    def __init__(self, optimizer: Optimizer, max_lr: float | Sequence[float], total_steps: int | None = None,
                 epochs: int | None = None, steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True,
                 base_momentum: float | Sequence[float] = 0.85, max_momentum: float | Sequence[float] = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False) -> None:
        if total_steps is None:
            if not (isinstance(epochs, int) and epochs > 0 and isinstance(steps_per_epoch, int)
                    and steps_per_epoch > 0):
                raise DeepxError("OneCycleLR: give total_steps, or epochs and steps_per_epoch (positive integers)")
            total_steps = epochs * steps_per_epoch
        if not isinstance(total_steps, int) or total_steps <= 0:
            raise DeepxError(f"OneCycleLR: total_steps must be a positive integer, got {total_steps!r}")
        if not 0 <= pct_start <= 1:
            raise DeepxError(f"OneCycleLR: pct_start must be between 0 and 1, got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise DeepxError(f"OneCycleLR: anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self.total_steps, self.anneal_strategy, self.cycle_momentum = total_steps, anneal_strategy, cycle_momentum
        p, n = pct_start, total_steps
        if three_phase:
            self.phases = [(float(p * n) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                           (float(2 * p * n) - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"),
                           (n - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum")]
        else:
            self.phases = [(float(p * n) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                           (n - 1, "max_lr", "min_lr", "base_momentum", "max_momentum")]
        groups = optimizer.param_groups

        def per_group(name: str, value: Any) -> list[float]:
            values = list(value) if isinstance(value, (list, tuple)) else [value] * len(groups)
            if len(values) != len(groups):
                raise DeepxError(f"OneCycleLR: {len(values)} values of {name} for {len(groups)} parameter groups")
            return [float(v) for v in values]

        for g, top in zip(groups, per_group("max_lr", max_lr)):
            g["initial_lr"] = top / div_factor
            g["max_lr"] = top
            g["min_lr"] = g["initial_lr"] / final_div_factor
        self.use_beta1 = "betas" in optimizer.defaults
        if cycle_momentum:
            if "momentum" not in optimizer.defaults and not self.use_beta1:
                raise DeepxError("OneCycleLR: cycle_momentum needs an optimizer with momentum or betas")
            for g, hi, lo in zip(groups, per_group("max_momentum", max_momentum),
                                 per_group("base_momentum", base_momentum)):
                if self.use_beta1:
                    g["betas"] = (hi, *g["betas"][1:])
                else:
                    g["momentum"] = hi
                g["max_momentum"], g["base_momentum"] = hi, lo
        super().__init__(optimizer)
        self.base_lrs = [g["initial_lr"] for g in groups]
        for g, lr in zip(groups, self._lrs()):
            g["lr"] = lr
        self._last_lr = [g["lr"] for g in groups]

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _lrs(self) -> list[float]:
        step = self.last_epoch
        if step > self.total_steps:
            raise DeepxError(f"OneCycleLR: stepped {step} times; total_steps is {self.total_steps}")
        lrs = []
        for g in self.optimizer.param_groups:
            start = 0.0
            for i, (end, lr0, lr1, m0, m1) in enumerate(self.phases):
                if step <= end or i == len(self.phases) - 1:
                    pct = (step - start) / (end - start)
                    lrs.append(self._anneal(g[lr0], g[lr1], pct))
                    if self.cycle_momentum:
                        momentum = self._anneal(g[m0], g[m1], pct)
                        if self.use_beta1:
                            g["betas"] = (momentum, *g["betas"][1:])
                        else:
                            g["momentum"] = momentum
                    break
                start = end
        return lrs


class _LRSchedulerModule:
    StepLR = StepLR
    CosineAnnealingLR = CosineAnnealingLR
    LambdaLR = LambdaLR
    LinearLR = LinearLR
    OneCycleLR = OneCycleLR


lr_scheduler = _LRSchedulerModule()
