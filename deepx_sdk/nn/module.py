"""Module: torch.nn.Module's registration, traversal, state dicts, train/eval and repr, for deepx tensors."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, Param
from deepx_sdk.nn.parameter import Parameter, check_source, load_into
from deepx_sdk.tensor import Tensor, data_handles, dtype_name

M = TypeVar("M", bound="Module")

_FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
_DEVICES = ("cpu", "cuda", "deepx", "mps", "meta")
_REGISTRIES = ("_parameters", "_buffers", "_modules")

# moved on by every change to any module's parameters, buffers or submodules (their registries are _Registry):
# what Module.structure() keys its cached walk on
_EPOCH = [0]

# the buffers made heap tensors (_to_heap), by id (a tensor's == is elementwise): a tensor registered again, or in
# another module, keeps its heap tensor
_HEAP_BUFFERS: dict[int, weakref.ref[Tensor]] = {}


class _Registry(OrderedDict):  # type: ignore[type-arg]
    """A module's parameters, buffers or submodules: an OrderedDict that moves _EPOCH on every change, whoever makes
    it (module code that writes `self._parameters[name]` directly too)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        _EPOCH[0] += 1

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        _EPOCH[0] += 1

    def pop(self, *args: Any) -> Any:
        _EPOCH[0] += 1
        return super().pop(*args)

    def popitem(self, last: bool = True) -> Any:
        _EPOCH[0] += 1
        return super().popitem(last)

    def clear(self) -> None:
        _EPOCH[0] += 1
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        _EPOCH[0] += 1
        super().update(*args, **kwargs)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        _EPOCH[0] += 1
        return super().setdefault(key, default)

    def move_to_end(self, key: Any, last: bool = True) -> None:
        _EPOCH[0] += 1
        super().move_to_end(key, last)


class IncompatibleKeys(NamedTuple):
    """What load_state_dict(strict=False) could not match, as torch's _IncompatibleKeys."""

    missing_keys: list[str]
    unexpected_keys: list[str]

    def __repr__(self) -> str:
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return f"_IncompatibleKeys(missing_keys={self.missing_keys}, unexpected_keys={self.unexpected_keys})"


def add_indent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    if len(lines) == 1:
        return text
    return lines[0] + "\n" + "\n".join(" " * spaces + line if line.strip() else "" for line in lines[1:])


class Module:
    """Base class of every layer: assigning a Parameter or a Module to an attribute registers it, so that
    parameters(), state_dict(), train()/eval() and repr() find it, as in torch."""

    training: bool
    _parameters: dict[str, Parameter | None]
    _buffers: dict[str, Tensor | None]
    _non_persistent: set[str]
    _modules: dict[str, Module | None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise DeepxError(f"{type(self).__name__}.__init__() got unexpected arguments {args} {kwargs}")
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", _Registry())
        object.__setattr__(self, "_buffers", _Registry())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", _Registry())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f'Module [{type(self).__name__}] is missing the required "forward" function')

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_labelled") != _EPOCH[0]:  # once, and again only after a registry changed
            _label_parameters(self)
        return self.forward(*args, **kwargs)

    # -- registration
    def _registry(self, kind: str) -> dict[str, Any]:
        reg = self.__dict__.get(kind)
        if reg is None:
            what = {"_parameters": "parameters", "_buffers": "buffers", "_modules": "modules"}[kind]
            raise AttributeError(f"cannot assign {what} before Module.__init__() call")
        return reg  # type: ignore[no-any-return]

    def _check_name(self, name: Any, what: str, kind: str) -> None:
        if not isinstance(name, str):
            raise DeepxError(f"{what} name should be a string, got {type(name).__name__}")
        if not name or "." in name:
            raise DeepxError(f"{what} name {name!r} cannot be empty or contain '.'")
        others = (k for k in _REGISTRIES if k != kind)
        if hasattr(type(self), name) or name in self.__dict__ or any(name in self.__dict__[k] for k in others):
            raise DeepxError(f"cannot register {what} {name!r}: attribute {name!r} already exists on "
                             f"{type(self).__name__}")

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        params = self._registry("_parameters")
        if name not in params:
            self._check_name(name, "parameter", "_parameters")
        if param is not None and not isinstance(param, Parameter):
            raise DeepxError(f"cannot assign '{type(param).__name__}' object to parameter '{name}' (dx.nn.Parameter "
                             "or None required); wrap it: nn.Parameter(tensor)")
        params[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        buffers = self._registry("_buffers")
        if name not in buffers:
            self._check_name(name, "buffer", "_buffers")
        if tensor is not None and not isinstance(tensor, Tensor):
            raise DeepxError(f"cannot assign '{type(tensor).__name__}' object to buffer '{name}' (dx.Tensor or None "
                             "required)")
        buffers[name] = _to_heap(tensor)
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        modules = self._registry("_modules")
        if module is not None and not isinstance(module, Module):
            raise DeepxError(f"{type(module).__name__} is not a Module subclass")
        if name not in modules:
            self._check_name(name, "module", "_modules")
        modules[name] = module

    register_module = add_module

    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        modules = self.__dict__.get("_modules")
        buffers = self.__dict__.get("_buffers")
        if isinstance(value, Parameter):
            self._registry("_parameters")
            self._forget(name, keep="_parameters")
            self.register_parameter(name, value)
        elif params is not None and name in params:
            if value is not None:
                raise DeepxError(f"cannot assign '{type(value).__name__}' as parameter '{name}' (dx.nn.Parameter or "
                                 "None expected)")
            params[name] = None
        elif isinstance(value, Module):
            self._registry("_modules")
            self._forget(name, keep="_modules")
            self.add_module(name, value)
        elif modules is not None and name in modules:
            if value is not None:
                raise DeepxError(f"cannot assign '{type(value).__name__}' as child module '{name}' (dx.nn.Module or "
                                 "None expected)")
            modules[name] = None
        elif buffers is not None and name in buffers:
            if value is not None and not isinstance(value, Tensor):
                raise DeepxError(f"cannot assign '{type(value).__name__}' as buffer '{name}' (dx.Tensor or None "
                                 "expected)")
            buffers[name] = _to_heap(value)
        else:
            object.__setattr__(self, name, value)

    def _forget(self, name: str, keep: str) -> None:
        """Drop `name` from every other registry (and plain attributes); in `keep` it keeps its position."""
        self.__dict__.pop(name, None)
        for kind in _REGISTRIES:
            if kind != keep:
                self.__dict__[kind].pop(name, None)
        self._non_persistent.discard(name)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for kind in _REGISTRIES:
            reg = d.get(kind)
            if reg is not None and name in reg:
                return reg[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for kind in _REGISTRIES:
            reg = self.__dict__.get(kind)
            if reg is not None and name in reg:
                del reg[name]
                self._non_persistent.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self) -> list[str]:
        names = set(super().__dir__())
        for kind in _REGISTRIES:
            names.update(self.__dict__.get(kind, ()))
        return sorted(n for n in names if not n.isdigit())

    # -- traversal
    def named_modules(self, memo: set[int] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Module]]:
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, module in self._modules.items():
            if module is None:
                continue
            yield from module.named_modules(memo, prefix + ("." if prefix else "") + name, remove_duplicate)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def structure(self) -> tuple[list[tuple[str, Parameter]], list[Module]]:
        """named_parameters() and modules() as lists, walked again only where a registry may have changed: what
        dx.compile reads on every call of a compiled step. The walk is kept with the epoch it was made at (every
        change to a _Registry moves it) and the registries it went through; it stands while the epoch does, every
        module walked still has those very registries (a registry replaced by a plain dict, or a module's __dict__
        swapped, shows), and this module is the one it was made for (a shallow copy shares the __dict__ entry)."""
        cached = self.__dict__.get("_structure")
        if cached is not None and cached[0] == _EPOCH[0]:
            epoch, params, mods, regs = cached
            if mods and mods[0] is self and all(
                    m.__dict__.get("_parameters") is r[0] and m.__dict__.get("_buffers") is r[1]
                    and m.__dict__.get("_modules") is r[2] for m, r in zip(mods, regs)):
                return params, mods
        epoch = _EPOCH[0]
        params, mods = list(self.named_parameters()), list(self.modules())
        regs = [(m.__dict__.get("_parameters"), m.__dict__.get("_buffers"), m.__dict__.get("_modules")) for m in mods]
        if all(type(r) is _Registry for rs in regs for r in rs):  # a plain dict's changes would not show
            object.__setattr__(self, "_structure", (epoch, params, mods, regs))
        else:
            self.__dict__.pop("_structure", None)
        return params, mods

    def __getstate__(self) -> dict[str, Any]:
        """The module's state for pickle and copy, without the cached walk (structure): it speaks of this process's
        objects and epoch."""
        state = dict(self.__dict__)
        state.pop("_structure", None)
        state.pop("_labelled", None)  # a copy's parameters are other tensors: labelled at its first call
        return state

    def named_children(self) -> Iterator[tuple[str, Module]]:
        seen: set[int] = set()
        for name, module in self._modules.items():
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield name, module

    def children(self) -> Iterator[Module]:
        for _, m in self.named_children():
            yield m

    def _named_members(self, kind: str, prefix: str, recurse: bool,
                       remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
        seen: set[int] = set()
        mods = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, self)]
        for mod_prefix, module in mods:
            for name, value in module.__dict__[kind].items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                if remove_duplicate:
                    seen.add(id(value))
                yield mod_prefix + ("." if mod_prefix else "") + name, value

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def get_submodule(self, target: str) -> Module:
        module: Module = self
        for item in target.split(".") if target else []:
            child = module._modules.get(item)
            if child is None:
                raise AttributeError(f"{module._get_name()} has no attribute `{item}`")
            module = child
        return module

    def get_parameter(self, target: str) -> Parameter:
        path, _, name = target.rpartition(".")
        p = self.get_submodule(path)._parameters.get(name)
        if p is None:
            raise AttributeError(f"`{name}` is not an nn.Parameter")
        return p

    def apply(self: M, fn: Callable[[Module], Any]) -> M:
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # -- state
    def _state_entries(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        """(dotted name, tensor) for every parameter and persistent buffer, each module visited once."""
        for mod_prefix, module in self.named_modules(prefix=prefix, remove_duplicate=True):
            dot = mod_prefix + ("." if mod_prefix else "")
            for name, p in module._parameters.items():
                if p is not None:
                    yield dot + name, p
            for name, b in module._buffers.items():
                if b is not None and name not in module._non_persistent:
                    yield dot + name, b

    def state_dict(self, destination: dict[str, Tensor] | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Tensor]:
        """Parameters and persistent buffers by torch's dotted names. The values are the module's own tensors
        (not copies): reading one reads the current weights, and an in-place change changes the module, as with
        torch's shared storage."""
        out: dict[str, Tensor] = OrderedDict() if destination is None else destination
        prefix = prefix[:-1] if prefix.endswith(".") else prefix
        for key, t in self._state_entries(prefix):
            out[key] = t
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> IncompatibleKeys:
        """Copy values (dx Tensors or numpy arrays) into this module's tensors, in place. Every key is checked
        before anything is copied, so a failed load leaves the module as it was."""
        if not isinstance(state_dict, Mapping):
            raise DeepxError(f"load_state_dict: expected a mapping of names to tensors, got "
                             f"{type(state_dict).__name__}")
        own = dict(self._state_entries())
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors: list[str] = []
        if strict:
            if missing:
                errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
        for key, target in own.items():
            if key in state_dict:
                problem = check_source(target, state_dict[key], key)
                if problem is not None:
                    errors.append(problem)
        if errors:
            raise DeepxError(f"Error(s) in loading state_dict for {self._get_name()}:\n\t" + "\n\t".join(errors))
        for key, target in own.items():
            if key in state_dict:
                load_into(target, state_dict[key], key)
        return IncompatibleKeys(missing, unexpected)

    # -- modes and conversions
    def train(self: M, mode: bool = True) -> M:
        if not isinstance(mode, bool):
            raise DeepxError(f"train(mode): mode is expected to be a bool, got {type(mode).__name__}")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self: M) -> M:
        return self.train(False)

    def requires_grad_(self: M, requires_grad: bool = True) -> M:
        for p in self.parameters():
            p.requires_grad = requires_grad
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def to(self: M, *args: Any, **kwargs: Any) -> M:
        """Modules need no device in deepx (the daemon places tensors): a device is accepted and ignored; a dtype
        converts the floating-point parameters and buffers, as torch's module.to(dtype)."""
        dtype = kwargs.get("dtype")
        for a in args:
            if isinstance(a, Tensor):
                dtype = a.dtype
            elif isinstance(a, str) and a.split(":")[0] in _DEVICES:
                continue
            elif a is not None and not isinstance(a, (int, bool)) and type(a).__name__ != "device":
                dtype = a
        if dtype is None:
            return self
        name = dtype_name(dtype)
        if name not in _FLOAT_DTYPES:
            raise DeepxError(f"nn.Module.to only accepts floating point dtypes, but got desired dtype={name}")
        return self._cast_floats(name)

    def _cast_floats(self: M, dtype: str) -> M:
        for m in self.modules():
            for p in m._parameters.values():
                if p is not None and p.dtype in _FLOAT_DTYPES and p.dtype != dtype:
                    _retype_heap(p, dtype)
            for b in m._buffers.values():
                if b is not None and b.dtype in _FLOAT_DTYPES and b.dtype != dtype:
                    _retype_heap(b, dtype)
        return self

    def float(self: M) -> M:
        return self._cast_floats("float32")

    def double(self: M) -> M:
        return self._cast_floats("float64")

    def half(self: M) -> M:
        return self._cast_floats("float16")

    def bfloat16(self: M) -> M:
        return self._cast_floats("bfloat16")

    def cpu(self: M) -> M:
        return self

    def cuda(self: M, device: Any = None) -> M:
        return self

    # -- repr
    def _get_name(self) -> str:
        return type(self).__name__

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        extra = self.extra_repr()
        extra_lines = extra.split("\n") if extra else []
        child_lines = [f"({key}): " + add_indent(repr(module), 2) for key, module in self._modules.items()]
        lines = extra_lines + child_lines
        body = ""
        if lines:
            if len(extra_lines) == 1 and not child_lines:
                body = extra_lines[0]
            else:
                body = "\n  " + "\n  ".join(lines) + "\n"
        return f"{self._get_name()}({body})"


def _label_parameters(module: Module) -> None:
    """Tell the daemon the module path of each parameter of `module` and its submodules (`0.weight`: deepxctl's
    PARAMETER), at the first call of the outermost module that is called; the submodules it calls are then not
    asked again (they would give their own, shorter paths). Sent with the next program, and only what changed."""
    params, mods = module.structure()
    epoch = _EPOCH[0]
    for m in mods:
        m.__dict__["_labelled"] = epoch
    for path, p in params:
        s = p._s
        if s is not None and not s.closed:
            s.labels.parameter(p.name, path)


def _to_heap(t: Tensor | None) -> Tensor | None:
    """A buffer as torch users expect it: a tensor the daemon keeps for the module (a heap tensor, as parameters are,
    decision 0009), written in place (`self.cache[:, pos] = k`) and shown by deepxctl. The handle given is moved
    onto a new heap tensor holding its values, so that the caller's reference is the buffer, as in torch. A tensor
    in an autograd graph (one with a grad_fn) stays where it is: its graph names it."""
    if t is None or isinstance(t, Parameter) or t.grad_fn is not None or t._s is None:
        return t
    ref = _HEAP_BUFFERS.get(id(t))
    if ref is not None and ref() is t:
        return t
    _retype_heap(t, t.dtype)
    key = id(t)
    _HEAP_BUFFERS[key] = weakref.ref(t, lambda r: _HEAP_BUFFERS.pop(key) if _HEAP_BUFFERS.get(key) is r else None)
    return t


def _retype_heap(p: Tensor, dtype: str) -> None:
    """Give `p` (a parameter, or a buffer) a new heap tensor of `dtype` holding its values; the handle stays the
    same, so references to it (an optimizer's, a caller's) stay valid, as with torch's param.data swap."""
    s = p._s
    new = s.names.new_name()
    s.recorder.made_here(new)
    _EPOCH[0] += 1  # the parameter's new tensor is labelled with its module path at the next call
    s.recorder.record(Instr("newtensor", (Param.vector(p.shape),), (Param.tensor(new, dtype),), (("kind", "heap"),)))
    s.recorder.record(Instr("todtype" if dtype != p.dtype else "copytensor", (Param.tensor(p.name, p.dtype),),
                            (Param.tensor(new, dtype),)))
    handles = data_handles(p)
    if handles:  # `d = p.data` before the cast: d keeps the old tensor, as torch's does, deleted when d goes
        keeper = Tensor(p.name, p.shape, p.dtype, s)
        keeper._k = None  # a heap tensor: deleted, never pooled
        for h in handles:
            h._o = keeper
    else:
        s.recorder.record(Instr("deltensor", (), (Param.tensor(p.name, p.dtype),)))
    p.name, p.dtype = new, dtype
    p._p = p._k = None  # its param named the old tensor (deepx_sdk.tensor._tp); it is deleted when collected
    if p.grad is not None:
        p.grad = p.grad.type_as_dtype(dtype)


__all__ = ["IncompatibleKeys", "Module"]
