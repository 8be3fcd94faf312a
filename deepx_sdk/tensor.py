"""Tensor: a handle (name, shape, dtype) whose operators record deepxIR instructions and never compute.

Shapes and dtypes are inferred here from the op catalogue, so a shape error is raised at the line that caused it.
Dtypes follow torch's promotion rules (an int tensor times 0.5 is float32, int / int is float). A tensor that
Python collects sends `deltensor`, so temporaries do not pile up in the daemon.
"""

from __future__ import annotations

import builtins
import inspect
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias
from weakref import ref as _weakref

import numpy as np

from deepx_core.cache import Cache
from deepx_core.errors import DeepxAttributeError, DeepxError
from deepx_core.ir.dtypes import FLOATS, INTS, to_numpy
from deepx_core.ir.dtypes import from_numpy as precision_of
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import OPS, Call, TensorMeta
from deepx_core.ir.shapes import broadcast, norm_dim, numel
from deepx_sdk.amp import lower as _amp_lower
from deepx_sdk.amp import state as _amp
from deepx_sdk.recorder import _IN_SDK, origin
from deepx_sdk.session import Session, session
from deepx_sdk.tape import graph_of, read_metas

Shape = tuple[int, ...]

# torch's default dtypes
DEFAULT_FLOAT = "float32"
DEFAULT_INT = "int64"

_FLOAT_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}
_INT_RANK = {"bool": 0, "int8": 1, "int16": 2, "int32": 3, "int64": 4}


def promote(a: str, b: str) -> str:
    """torch.result_type for two tensor dtypes."""
    if a == b:
        return a
    fa, fb = a in _FLOAT_RANK, b in _FLOAT_RANK
    if fa and fb:
        if {a, b} == {"float16", "bfloat16"}:
            return "float32"
        return a if _FLOAT_RANK[a] >= _FLOAT_RANK[b] else b
    if fa:
        return a
    if fb:
        return b
    return a if _INT_RANK.get(a, 0) >= _INT_RANK.get(b, 0) else b


_BOOL_AS_INT8 = frozenset({"add", "mul", "max", "min"})


_CATEGORY = {**dict.fromkeys(_INT_RANK, 1), **dict.fromkeys(_FLOAT_RANK, 2), "bool": 0}


def result_type(a: Tensor, b: Tensor) -> str:
    """torch.result_type for two tensors: a 0-d tensor next to a dimensioned one counts only when its category (bool,
    integer, floating) is higher, as torch has it."""
    if (a.ndim == 0) == (b.ndim == 0):
        return promote(a.dtype, b.dtype)
    dim, zero = (a, b) if b.ndim == 0 else (b, a)
    return zero.dtype if _CATEGORY.get(zero.dtype, 2) > _CATEGORY.get(dim.dtype, 2) else dim.dtype


def scalar_dtype(t: str, s: Any) -> str:
    """The dtype of `tensor op python-scalar` (a scalar never widens a tensor of its own kind)."""
    if isinstance(s, bool):
        return t
    if isinstance(s, float):
        return t if t in _FLOAT_RANK else DEFAULT_FLOAT
    if isinstance(s, int):
        return t if t != "bool" else DEFAULT_INT
    raise DeepxError(f"unsupported operand {s!r} of type {type(s).__name__}; use a Tensor, an int or a float")


_getframe = sys._getframe
# Instr and Param are named tuples: tuple.__new__ builds one without the named tuple's Python-level __new__
_tuple_new = tuple.__new__
# one precision tuple per dtype, shared by every param of that dtype (programs that repeat then compare by identity)
_PRECISIONS: dict[str, tuple[str]] = {}


def _viewed(out: Tensor, base: Tensor, always: bool = False) -> Tensor:
    """`out`, made from `base` by a view (a copy in deepx), marked as such where it is outside autograd (or
    `always`: an index's result): see Tensor._check_write."""
    if always or not out.requires_grad:
        out._b = _bases(base)
    return out


def _bases(base: Tensor) -> tuple[Any, ...]:
    """Weak references to what a view of `base` shares memory with in torch: `base`, what `base` is itself a view of
    (still alive), and the tensor a `.data` handle stands for."""
    refs = [_weakref(base)]
    up = getattr(base, "_b", None)
    if up is not None:
        refs.extend(r for r in up if r() is not None)
    owner = getattr(base, "_o", None)
    if owner is not None:
        refs.append(_weakref(owner))
    return tuple(refs)


#: the `.data` handles made of each parameter, weakly, by the parameter's id: a parameter that takes a new tensor
#: (nn.Module.half(), which changes its name) hands its old one to them instead of deleting it, as torch's old `.data`
#: keeps its storage. Weak references by hand: a WeakSet compares its tensors with ==, which is elementwise
_DATA_HANDLES: dict[_int, list[Any]] = {}


def _note_handle(owner: Tensor, handle: Tensor) -> None:
    key = id(owner)
    refs = _DATA_HANDLES.get(key)
    if refs is None:
        def forget(_: Any, k: _int = key) -> None:
            _DATA_HANDLES.pop(k, None)

        # setdefault: two threads taking a first .data at once share one list (neither registration is lost)
        refs = _DATA_HANDLES.setdefault(key, [_weakref(owner, forget)])
    if len(refs) > 16:
        refs[1:] = [r for r in refs[1:] if r() is not None]
    refs.append(_weakref(handle))


def data_handles(t: Tensor) -> list[Tensor]:
    """The live `.data` handles of parameter `t` that name its tensor now."""
    refs = _DATA_HANDLES.get(id(t))
    if not refs or refs[0]() is not t:
        return []
    return [h for h in (r() for r in refs[1:]) if h is not None and h.name == t.name]


def _precision(dtype: str) -> tuple[str]:
    p = _PRECISIONS.get(dtype)
    if p is None:
        p = _PRECISIONS[dtype] = (dtype,)
    return p


def _tp(t: Tensor) -> Param:
    """The tensor as a param; built once per (name, dtype) of the handle and kept on it."""
    p = t._p
    if p is not None and p.value is t.name and p.precisions[0] is t.dtype:
        return p
    p = t._p = _tuple_new(Param, ("tensor", _precision(t.dtype), t.name))
    return p


_VAR_PRECISION = {bool: ("bool",), int: ("int32",), float: ("float32",)}


def _vp(v: Any) -> Param:
    prec = _VAR_PRECISION.get(type(v))
    if prec is None:
        return Param.var(v)
    return _tuple_new(Param, ("var", prec, v))


def _vec(v: Iterable[int]) -> Param:
    if type(v) is tuple:
        p = _VECTORS.get(v)
        if p is None:
            p = _VECTORS.put(v, Param("vector", ("int32",), tuple(int(x) for x in v)))
        return p
    return Param("vector", ("int32",), tuple(int(x) for x in v))


# vector params by the tuple they were made from (equal tuples of numbers make equal int vectors)
_VECTORS: Cache[tuple[Any, ...], Param] = Cache("sdk.vectors", 4096, counted=False)
_SWAP = Param("vector", ("int32",), (1, 0))  # a matrix's transpose (every Linear's weight, every step)

def infer_meta(name: str, args: list[Any], names: list[Any]) -> TensorMeta:
    """The result meta of op `name` on `args` by the catalogue's shape and dtype rule (raises DeepxError)."""
    op = OPS[name]
    out = op.infer(Call(op, args, names, [None], ["any"], ["?"]))[0]
    assert out is not None
    return out


# (op, *args) -> the result meta that infer_meta gave
_INFERRED: Cache[Any, TensorMeta] = Cache("sdk.inferred", 65536, counted=False)
# what a reduction or a reshape records, by what decides it: (op, shape, dtype, dim, keepdim) -> (shape, dtype, dims
# param, keepdim param); (shape, new shape) -> (shape, shape param)
_REDUCTIONS: Cache[Any, tuple[Any, str, Param, Param]] = Cache("sdk.reductions", 4096, counted=False)
_RESHAPES: Cache[Any, tuple[Any, Param]] = Cache("sdk.reshapes", 4096, counted=False)

# Tensor has methods named bool, int and float: annotations inside it use these
_bool: TypeAlias = bool
_int: TypeAlias = int
_float: TypeAlias = float


_new_object = object.__new__
# name -> the returns of an instruction that makes it: a loop's pooled names come back every step, and then so do
# these objects (fewer allocations, and programs that compare by identity)
_RETURNS: Cache[str, tuple[Param]] = Cache("sdk.returns", 16384, counted=False)


#: results of at least this many elements are deleted when collected instead of pooled with their buffers (their
#: names are reused either way, so that a loop sends the same program every step): a value the daemon knows is dead
#: can be fused away, which saves a pass over memory; below this, the deltensor costs more than a pass
DELETE_MIN = 1 << 15


def _large(shape: Shape) -> bool:
    n = 1
    for d in shape:
        n *= d
    return n >= DELETE_MIN


def _emit(s: Session, name: str, args: tuple[Param, ...], shape: Shape, dtype: str, depth: int,
          deleted: bool = False) -> Tensor:
    """Append `name(args) -> (a new tensor)` to the session's pending program: the recording hot path, one Python
    call for all of it. `depth`: how many frames up from here the user's code can first be (every frame on the
    way is the SDK's); only that frame is looked at, and its line is worked out only if an error names it.
    `deleted`: the result is deleted once collected (a transpose, a view in the daemon), and named as such
    (Recorder.deleted_name)."""
    rname = None
    collected = s.collected
    pending = s.pending
    if collected and len(collected) == 1 and not deleted:
        names = s.names
        if not names.lost:
            # the handle this result replaces in a loop: its name, shape and dtype fit, so the result takes the name
            # (as Recorder.reuse_name would, without the call)
            try:
                item = collected.popleft()
            except IndexError:
                pass
            else:
                if item[1] == dtype and item[2] == shape and len(item) == 3:
                    rname = item[0]
                    names.reused.add(rname)
                    names.taken[rname] = len(pending)
                    out = _new_object(Tensor)
                    out._k = item
                else:
                    collected.appendleft(item)
    if rname is None:
        rname = s.recorder.deleted_name(shape, dtype) if deleted else s.recorder.reuse_name(shape, dtype)
        out = _new_object(Tensor)
        # never a gradient's name: those are neither pooled nor numbered. A large result is deleted once collected
        # (its name is reused all the same, like a transpose's): the daemon then knows the value is dead where the
        # program ends, and its passes may fuse it away (a Linear's bias add into the ReLU after it)
        out._k = (rname, dtype, shape, True) if deleted or _large(shape) else (rname, dtype, shape)
    out.name = rname
    out.shape = shape
    out.dtype = dtype
    out._s = s
    out.requires_grad = False
    out.grad = None
    out.grad_fn = None
    prec = _PRECISIONS.get(dtype) or _precision(dtype)
    rets = _RETURNS.get(rname)
    if rets is None or rets[0][1] is not prec:
        rets = _RETURNS.put(rname, (_tuple_new(Param, ("tensor", prec, rname)),))
    out._p = rets[0]
    pending.append(_tuple_new(Instr, (name, args, rets, ())))
    try:
        f: Any = _getframe(depth)
    except ValueError:  # fewer frames than that: the SDK was called from the top of a thread
        f = None
    if f is not None:
        code = f.f_code
        k = id(code)
        known = _IN_SDK.get(k)
        if known is not None and not known[1]:  # the common case: the user's code, seen before
            lasti = f.f_lasti
            # an int, not a tuple: nothing for the garbage collector to track (recorder.origin_of reads both forms)
            s.origins.append(k << 24 | lasti if lasti < 16777216 else (code, lasti))
        else:
            s.origins.append(origin(f))
    else:
        s.origins.append(None)
    if len(pending) >= s.max_pending:
        s.recorder.flush_full()
    return out


def _arith(op: str, scalar_op: str, rscalar_op: str | None = None, reverse: bool = False,
           floating: bool = False) -> Any:
    """An operator method (a + b, a * 2.0, ...): the common cases recorded straight away (tensors of one shape and
    float dtype, or a Python number next to a float tensor, nothing requiring grad); the rest by Tensor._binary."""

    def method(self: Tensor, other: Any) -> Tensor:
        dt = self.dtype
        kind = type(other)
        if kind is Tensor:
            if (other.dtype == dt and other.shape == self.shape and dt in _FLOAT_RANK
                    and not (self.requires_grad or other.requires_grad)
                    and not self._s.explicit_broadcast):
                a, b = (other, self) if reverse else (self, other)
                # a handle's _p is its param, made by _tp for the name and dtype it has for life (the one place
                # that gives a handle another name, nn.module._retype_heap, clears it)
                pa, pb = a._p or _tp(a), b._p or _tp(b)
                return _emit(self._s, op, (pa, pb), self.shape, dt, 2)
        elif (kind is float or kind is int) and dt in _FLOAT_RANK and not self.requires_grad:
            pa = self._p or _tp(self)
            pv = _tuple_new(Param, ("var", _VAR_PRECISION[kind], other))
            if not reverse:
                return _emit(self._s, scalar_op, (pa, pv), self.shape, dt, 2)
            if rscalar_op is not None:
                return _emit(self._s, rscalar_op, (pv, pa), self.shape, dt, 2)
        return self._binary(op, other, scalar_op, rscalar_op, reverse, floating)

    method.__name__ = method.__qualname__ = f"_{op}{'_reversed' if reverse else ''}"
    return method


#: elementwise methods that autocast runs in float32 (torch's CUDA list), and the dtypes it casts up for them
_AMP_FLOAT32 = frozenset({"exp", "log", "log1p", "expm1", "tan", "reciprocal"})
_HALF = frozenset({"bfloat16", "float16"})


def _float_unary(op: str) -> Any:
    """A float elementwise method (x.exp(), x.relu(), ...): a float tensor that requires no grad recorded straight
    away, the rest by Tensor._unary (an integer tensor is cast to float first, as torch does)."""

    up = op in _AMP_FLOAT32  # autocast runs it in float32

    def method(self: Tensor) -> Tensor:
        if up and _amp.dtype is not None and self.dtype in _HALF:
            return getattr(self.type_as_dtype("float32"), op)()
        if self.dtype in _FLOAT_RANK and not self.requires_grad:
            return _emit(self._s, op, (self._p or _tp(self),), self.shape, self.dtype, 2)
        return self._unary(op)

    method.__name__ = method.__qualname__ = op
    return method


def _index_of(what: str, index: Any) -> Tensor:
    """An index tensor for gather and scatter: int64 or int32, as torch takes."""
    if not isinstance(index, Tensor):
        raise DeepxError(f"{what}: index must be a Tensor of int64, got {type(index).__name__}")
    if index.dtype not in ("int64", "int32"):
        raise DeepxError(f"{what}: index must be int64 (or int32), got {index.dtype}")
    return index


def _rounding(op: str) -> Any:
    """floor, ceil, trunc: a float tensor rounded by the op; an integer or bool tensor is whole already and comes back
    as a copy, as torch's."""

    def method(self: Tensor) -> Tensor:
        if self.dtype not in _FLOAT_RANK:
            return self.clone()
        if not self.requires_grad:
            return _emit(self._s, op, (self._p or _tp(self),), self.shape, self.dtype, 2)
        return self._op(op, (_tp(self),), self.shape, self.dtype, (self,))

    method.__name__ = method.__qualname__ = op
    return method


class Tensor:
    """A deepx tensor. Model code uses it like a torch.Tensor; values live in the daemon."""

    # _k: what __del__ hands the session's collected queue, (name, dtype, shape or None: never pooled), worked out
    # when the tensor is made (a loop's result takes the very tuple of the handle it replaces); a fourth item True:
    # deleted when collected, and its name pooled all the same (a transpose's: see permute)
    # _b: set on a view's result (reshape, transpose, an index, expand, detach: copies in deepx, views in torch), a
    # weak reference to the tensor it came from, so that writing the copy in place while that one lives raises
    # (see _check_write); _o: set on a `.data` handle, the tensor whose name it shares (kept alive by it); _w: the
    # tape's count at this tensor's last in-place write that is not on the tape (see Tape.wrote)
    __slots__ = ("__weakref__", "_b", "_k", "_o", "_p", "_s", "_v", "_w", "dtype", "grad", "grad_fn", "name",
                 "requires_grad", "shape")
    _v: tuple[_int, np.ndarray] | None  # set only where a value came back with the tensor's making (see numpy())
    _b: tuple[Any, ...]  # a view's bases, weakly (see _check_write); unset on most tensors
    _o: Tensor  # a .data handle's owner; unset on others

    def __init__(self, name: str, shape: Shape, dtype: str, sess: Session, requires_grad: _bool = False) -> None:
        if requires_grad and dtype not in FLOATS:
            raise DeepxError(f"only floating-point tensors can require gradients, got {dtype}")
        self._p: Param | None = None
        self.name = name
        self.shape = shape if type(shape) is tuple else tuple(shape)
        self.dtype = dtype
        self._s = sess
        self.requires_grad = requires_grad
        self.grad: Tensor | None = None
        self.grad_fn: Any = None
        self._k: tuple[Any, ...] | bool | None = (
            (name, dtype, self.shape) if type(self) is Tensor and sess is not None
            and not name.startswith(sess.names.grad_root) else None)

    def __del__(self) -> None:
        try:
            k = self._k
        except AttributeError:  # a Parameter, or a half-built tensor (copy, unpickling)
            k = None
        if k is False or k is True:  # a `.data` handle: another handle owns the name
            return
        try:
            # never blocks: collection runs in any thread. Plain results may have their name reused (pooled);
            # parameters and other kinds are always deleted (_k None), and so are a backward's gradient names: their
            # prefix is handed out again (Session.grad_prefix). A handle that nn.module._retype_heap gave another
            # name has _k None. A closed session's queue is never read; a half-built tensor has no session
            self._s.collected.append(k or (self.name, self.dtype, None))
        except Exception:  # no session, or interpreter shutdown
            pass

    # -- basics
    @property
    def ndim(self) -> _int:
        return len(self.shape)

    def dim(self) -> _int:
        return len(self.shape)

    def size(self, dim: _int | None = None) -> Any:
        return self.shape if dim is None else self.shape[norm_dim("size", dim, self.ndim)]

    def numel(self) -> _int:
        return numel(self.shape)

    def __len__(self) -> _int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    @property
    def device(self) -> Any:
        """Where the daemon keeps this tensor: device('cuda', 0) on an op-cuda daemon, device('cpu') otherwise
        (deepx_sdk/devices.py)."""
        from deepx_sdk.devices import session_device

        return session_device(self._s)

    @property
    def is_cuda(self) -> _bool:
        return self.device.type == "cuda"

    @property
    def is_leaf(self) -> _bool:
        return self.grad_fn is None

    # -- reading values (these send the pending program)
    def numpy(self) -> np.ndarray:
        v = getattr(self, "_v", None)  # a value read back with the replay that made this tensor (deepx_sdk/compile)
        if v is not None:
            s = self._s
            rec = s.recorder
            if v[0] == rec.runs and not s.pending and rec.capture is None:  # nothing sent or recorded since
                return v[1].copy()  # type: ignore[no-any-return]
            self._v = None
        return self._s.recorder.sync(fetch=(self.name,))[self.name]

    def item(self) -> Any:
        if self.numel() != 1:
            raise DeepxError(f"item(): tensor '{self.name}' has {self.numel()} elements, not 1")
        return self.numpy().reshape(-1)[0].item()

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def __float__(self) -> _float:
        return float(self.item())

    def __int__(self) -> _int:
        return int(self.item())

    def __bool__(self) -> _bool:
        return bool(self.item())

    def __index__(self) -> _int:
        if self.dtype not in INTS:
            raise TypeError("only integer tensors can be used as an index")
        return int(self.item())

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.numpy()
        return a.astype(dtype) if dtype is not None else a

    def __repr__(self) -> str:
        try:
            values = self.numpy()
        except DeepxError as e:
            return f"tensor(<unavailable: {e}>, shape={list(self.shape)}, dtype={self.dtype})"
        return format_tensor(values, self.dtype, self.requires_grad)

    __str__ = __repr__

    def __iter__(self) -> Any:
        for i in range(len(self)):
            yield self[i]

    # -- recording helpers
    def _new(self, shape: Shape, dtype: str) -> Tensor:
        return Tensor(self._s.recorder.reuse_name(shape, dtype), shape, dtype, self._s)

    def _op(self, name: str, args: tuple[Param, ...], shape: Shape, dtype: str, inputs: Sequence[Tensor],
            depth: _int = 2, deleted: _bool = False) -> Tensor:
        """Record `name(args) -> new tensor`. `depth`: how many frames up the user's code can first be (each frame
        on the way is the SDK's): 2, the caller's caller, as only the SDK calls this; looking there directly skips
        materializing the frames in between. `deleted`: as _emit's."""
        s = self._s
        out = _emit(s, name, args, shape, dtype, depth + 1, deleted)
        for t in inputs:
            if t.requires_grad:
                if dtype in FLOATS and s._grad_mode.on:  # an integer or bool result has no gradient, as in torch
                    out.requires_grad = True
                    s.tape.made(_tuple_new(Instr, (name, args, (out._p,), ())), out, tuple(inputs))
                break
        return out

    def backward(self, gradient: Any = None, retain_graph: _bool = False) -> None:
        """Gradients of this tensor with respect to every leaf that requires grad, accumulated into `.grad`.

        The daemon's autograd pass rewrites the recorded forward graph that reaches this tensor (and nothing else of
        the session's) into the backward program and runs it. That graph is freed afterwards unless
        retain_graph=True; other graphs are left as they are."""
        s = self._s
        if not self.requires_grad:
            raise DeepxError("backward: this tensor does not require grad and has no grad_fn (did a leaf "
                             "have requires_grad=True, and was it computed outside dx.no_grad()?)")
        root = self.grad_fn
        grad_loss: Tensor | None = None
        if gradient is None:
            if self.numel() != 1:
                raise DeepxError(f"backward: grad can be implicitly created only for scalar outputs; "
                                 f"'{self.name}' has shape {self.shape}")
        else:
            grad_loss = gradient if isinstance(gradient, Tensor) else tensor(gradient, dtype=self.dtype)
            grad_loss = grad_loss.type_as_dtype(self.dtype)
            if grad_loss.shape != self.shape:
                raise DeepxError(f"backward: gradient of shape {grad_loss.shape} does not match {self.shape}")
        loss = self
        if gradient is None and self.shape != ():
            if root is not None:
                graph_of(root, self.name)  # refuses a freed graph before anything is recorded
            before, s.grad_enabled = s.grad_enabled, True
            try:
                loss = self.reshape(())
            finally:
                s.grad_enabled = before
            root = loss.grad_fn
        path: list[Any]
        forward: list[Instr]
        leaves: dict[str, Any]
        if root is None:  # a leaf: d leaf / d leaf, as torch gives it
            path, forward, leaves = [], [], {self.name: self}
        else:
            path, forward, leaves = graph_of(root, self.name)
        with s._lock:  # one backward at a time: threads of one session share its gradient names
            upstream = grad_loss.name if grad_loss is not None else None
            prefix, k = s.names.grad_prefix()
            # the gradients' names: the same every step of a loop (prefix k comes back once its gradients are gone)
            grads = {w: f"{prefix}r{i}" for i, w in enumerate(leaves)}
            spec = {"forward": forward, "loss": loss.name, "wrt": list(leaves), "grad_loss": upstream,
                    "prefix": prefix, "names": grads}
            rec = s.recorder
            transport = rec.transport  # (a capture's stand-in while dx.compile captures)
            if transport.takes_backwards and rec.capture is None and s.names.differentiated(
                    k, spec, lambda: read_metas(path)):
                # run before under these names (a training loop): recorded, and expanded by the daemon where it
                # stands in the program, so that the whole step goes as one program
                rec.record_backward(Instr("backward", (_tp(loss),), tuple(Param.tensor(n, leaves[w].dtype)
                                                                          for w, n in grads.items())), spec)
            else:
                # the first time: derived and run now, so that a graph without a gradient raises here
                rec.sync()
                try:
                    rec.sent_request()
                    grads = transport.backward(forward, loss.name, list(leaves), upstream, prefix, grads)
                except BaseException:
                    s.names.grad_prefix_failed(k)
                    raise
                s.names.note_differentiated(k, spec, read_metas(path))
            s.names.grad_prefix_taken(k, len(grads))
            with _no_tape(s):
                for name, leaf in leaves.items():
                    g = Tensor(grads[name], leaf.shape, leaf.dtype, s)
                    if leaf.grad is None:
                        leaf.grad = g
                    else:  # accumulated in place, as torch's: a handle on .grad held from before sees the sum
                        leaf.grad._assign(leaf.grad + g, "backward")
        if not retain_graph:
            for node in path:
                node.free()
        if _GRAD_HOOKS:
            _after_accumulate(leaves.values())

    def register_post_accumulate_grad_hook(self, hook: Any) -> _HookHandle:
        """Call hook(tensor) after each backward that accumulated this leaf's `.grad`, as torch's (DDP's
        all-reduce of the gradients hangs on it). Returns a handle whose remove() takes it away."""
        if self.grad_fn is not None:
            raise DeepxError("register_post_accumulate_grad_hook: only leaf tensors accumulate a .grad; "
                             f"'{self.name}' was computed by an op")
        entry = _GRAD_HOOKS.get(id(self))
        if entry is None:
            entry = _GRAD_HOOKS[id(self)] = (_weakref(self, _hooks_gone(id(self))), [])
        entry[1].append(hook)
        return _HookHandle(entry[1], hook)

    def _infer(self, name: str, args: list[Any], names: list[Any]) -> TensorMeta:
        """The op's result meta by the catalogue's rule, remembered by (op, args): a loop asks the same again and
        again. The rule reads names only for its error messages, and an error is never remembered."""
        try:
            key: Any = (name, *args)
            out = _INFERRED.get(key)
        except TypeError:  # a list among the args
            key, out = None, None
        if out is not None:
            return out
        out = infer_meta(name, args, names)
        if key is not None:
            _INFERRED.put(key, out)
        return out

    # -- dtype
    def to(self, *args: Any, **kwargs: Any) -> Tensor:
        """torch's forms: to(dtype), to(device), to(device, dtype), to(other) (other's dtype), with dtype=,
        device=, non_blocking= and copy= as keywords. A device is a hint the daemon has no use for (it places every
        tensor: deepx_sdk/devices.py); copy=True gives a new tensor even where nothing changes."""
        from deepx_sdk.devices import device, is_device

        dtype = kwargs.pop("dtype", None)
        copy = kwargs.pop("copy", False)
        where = kwargs.pop("device", None)
        kwargs.pop("non_blocking", None)
        kwargs.pop("memory_format", None)
        if kwargs:
            raise DeepxError(f"Tensor.to: unexpected keyword {', '.join(map(repr, kwargs))}")
        for a in args:
            if isinstance(a, Tensor):
                dtype = a.dtype
            elif is_device(a):
                where = a
            elif isinstance(a, _bool):  # to(dtype, non_blocking, copy) as positional flags
                continue
            elif a is not None:
                dtype = a
        if where is not None:
            device(where)  # a malformed device string says so
        out = self if dtype is None else self.type_as_dtype(dtype_name(dtype))
        return out.clone() if copy and out is self else out

    def cuda(self, device: Any = None, non_blocking: _bool = False) -> Tensor:
        """torch's x.cuda(): the daemon places tensors, so this is x (on a daemon with or without a GPU)."""
        return self

    def type(self, dtype: Any = None, non_blocking: _bool = False) -> Any:
        """torch's x.type(): with no dtype, the tensor type's name ('torch.FloatTensor' style, as
        'deepx.FloatTensor'); with one, the tensor converted to it."""
        if dtype is None:
            return f"deepx.{_TYPE_NAMES.get(self.dtype, self.dtype)}"
        if isinstance(dtype, str) and dtype.startswith(("torch.", "deepx.")) and dtype.endswith("Tensor"):
            found = [k for k, v in _TYPE_NAMES.items() if v == dtype.split(".", 1)[1]]
            if not found:
                raise DeepxError(f"Tensor.type: unknown tensor type {dtype!r}")
            dtype = found[0]
        return self.type_as_dtype(dtype_name(dtype))

    def type_as_dtype(self, dtype: str) -> Tensor:
        if dtype == self.dtype:
            return self
        to_numpy(dtype)
        return self._op("todtype", (_tp(self),), self.shape, dtype, [self])

    def float(self) -> Tensor:
        return self.type_as_dtype("float32")

    def double(self) -> Tensor:
        return self.type_as_dtype("float64")

    def half(self) -> Tensor:
        return self.type_as_dtype("float16")

    def bfloat16(self) -> Tensor:
        return self.type_as_dtype("bfloat16")

    def int(self) -> Tensor:
        return self.type_as_dtype("int32")

    def long(self) -> Tensor:
        return self.type_as_dtype("int64")

    def bool(self) -> Tensor:
        return self.type_as_dtype("bool")

    def type_as(self, other: Tensor) -> Tensor:
        return self.type_as_dtype(other.dtype)

    def is_floating_point(self) -> _bool:
        return self.dtype in FLOATS

    # -- elementwise arithmetic
    def _coerce(self, other: Any) -> Tensor | None:
        return other if isinstance(other, Tensor) else None

    def _binary(self, op: str, other: Any, scalar_op: str, rscalar_op: str | None = None,
                reverse: _bool = False, floating: _bool = False) -> Tensor:
        dt = self.dtype
        kind = type(other)
        # the common cases first: a tensor of the same shape and dtype, or a Python number next to a float tensor
        if kind is Tensor:
            if (other.dtype == dt and other.shape == self.shape and dt in _FLOAT_RANK
                    and not self._s.explicit_broadcast):
                # depth 3: _op <- _binary <- the operator method <- its caller
                if reverse:
                    return self._op(op, (_tp(other), _tp(self)), self.shape, dt, (other, self), 3)
                return self._op(op, (_tp(self), _tp(other)), self.shape, dt, (self, other), 3)
        elif (kind is float or kind is int) and dt in _FLOAT_RANK:
            if not reverse:
                return self._op(scalar_op, (_tp(self), _vp(other)), self.shape, dt, (self,), 3)
            if rscalar_op is not None:
                return self._op(rscalar_op, (_vp(other), _tp(self)), self.shape, dt, (self,), 3)
        return self._binary_general(op, other, scalar_op, rscalar_op, reverse, floating)

    def _binary_general(self, op: str, other: Any, scalar_op: str, rscalar_op: str | None,
                        reverse: _bool, floating: _bool) -> Tensor:
        if self.dtype == "bool" and op in _BOOL_AS_INT8 and (
                other.dtype == "bool" if isinstance(other, Tensor) else isinstance(other, (bool, np.bool_))):
            # torch: _bool + bool is logical or, _bool * bool logical and; the kernels have no bool arithmetic
            return self.type_as_dtype("int8")._binary(op, other, scalar_op, rscalar_op, reverse).bool()
        if isinstance(other, Tensor):
            a, b = (other, self) if reverse else (self, other)
            dt = result_type(a, b)
            if floating and dt not in _FLOAT_RANK:
                dt = DEFAULT_FLOAT
            a, b = a.type_as_dtype(dt), b.type_as_dtype(dt)
            shape = a.shape if a.shape == b.shape else broadcast(op, a.shape, b.shape, names=[a.name, b.name])
            if self._s.explicit_broadcast:
                a, b = a.expand(shape), b.expand(shape)
            return self._op(op, (_tp(a), _tp(b)), shape, dt, [a, b])
        if isinstance(other, (np.generic,)):
            other = other.item()
        dt = scalar_dtype(self.dtype, other)
        if floating and dt not in _FLOAT_RANK:
            dt = DEFAULT_FLOAT
        other = _number(other)
        a = self.type_as_dtype(dt)
        if reverse:
            if rscalar_op is None:
                return a._op(op, (_tp(a._full_like_scalar(other)), _tp(a)), a.shape, dt, [a])
            return a._op(rscalar_op, (_vp(other), _tp(a)), a.shape, dt, [a])
        return a._op(scalar_op, (_tp(a), _vp(other)), a.shape, dt, [a])

    def _full_like_scalar(self, value: Any) -> Tensor:
        return full(self.shape, value, dtype=self.dtype)

    __add__ = __radd__ = _arith("add", "addscalar")
    __sub__ = _arith("sub", "subscalar")
    __rsub__ = _arith("sub", "subscalar", "rsubscalar", reverse=True)
    __mul__ = __rmul__ = _arith("mul", "mulscalar")
    __truediv__ = _arith("div", "divscalar", floating=True)
    __rtruediv__ = _arith("div", "divscalar", "rdivscalar", reverse=True, floating=True)
    __pow__ = _arith("pow", "powscalar")
    __rpow__ = _arith("pow", "powscalar", "rpowscalar", reverse=True)

    def __neg__(self) -> Tensor:
        return self._op("neg", (_tp(self),), self.shape, self.dtype, [self])

    def __pos__(self) -> Tensor:
        return self

    def __abs__(self) -> Tensor:
        return self.abs()

    def __invert__(self) -> Tensor:
        if self.dtype in FLOATS:
            raise DeepxError(f"~ (invert) needs an integer or bool tensor; '{self.name}' is {self.dtype}")
        return self._op("invert", (_tp(self),), self.shape, self.dtype, [self])

    # torch's named forms of the operators: the module's functions (also dx.add, ...), this tensor first
    def add(self, other: Any, alpha: Any = 1) -> Tensor:
        return add(self, other, alpha=alpha)

    def sub(self, other: Any, alpha: Any = 1) -> Tensor:
        return sub(self, other, alpha=alpha)

    def rsub(self, other: Any, alpha: Any = 1) -> Tensor:
        return rsub(self, other, alpha=alpha)

    def mul(self, other: Any) -> Tensor:
        return mul(self, other)

    def div(self, other: Any, rounding_mode: str | None = None) -> Tensor:
        return div(self, other, rounding_mode=rounding_mode)

    multiply, subtract, divide, true_divide = mul, sub, div, div

    def matmul(self, other: Tensor) -> Tensor:
        return matmul(self, other)

    def mm(self, other: Tensor) -> Tensor:
        if self.ndim != 2 or getattr(other, "ndim", None) != 2:
            raise DeepxError(f"mm: both operands must be 2-D, got {self.shape} and {getattr(other, 'shape', other)}")
        return matmul(self, other)

    def bmm(self, other: Tensor) -> Tensor:
        if self.ndim != 3 or getattr(other, "ndim", None) != 3 or self.shape[0] != other.shape[0]:
            raise DeepxError(f"bmm: both operands must be 3-D with the same batch, got {self.shape} and "
                             f"{getattr(other, 'shape', other)}")
        return matmul(self, other)

    def index_add(self, dim: _int, index: Tensor, source: Tensor, *, alpha: Any = 1) -> Tensor:
        """torch's: this tensor with source's slices added at `index` along `dim` (repeated indices add up)."""
        if index.dtype not in ("int64", "int32") or index.ndim != 1:
            raise DeepxError(f"index_add: the index must be a 1-D int64 or int32 tensor, got {index.dtype} "
                             f"{list(index.shape)}")
        if source.dtype != self.dtype:  # as torch: no silent cast
            raise DeepxError(f"index_add: source is {source.dtype}, '{self.name}' is {self.dtype}; they must match")
        src = source * alpha if alpha != 1 else source
        d = norm_dim("index_add", dim, builtins.max(self.ndim, 1))
        self._infer("indexadd", [TensorMeta(self.shape, self.dtype), TensorMeta(index.shape, index.dtype),
                                 TensorMeta(src.shape, src.dtype), d], [self.name, index.name, src.name, None])
        return self._op("indexadd", (_tp(self), _tp(index), _tp(src), Param.var(d)), self.shape, self.dtype,
                        [self, index, src])

    def index_add_(self, dim: _int, index: Tensor, source: Tensor, *, alpha: Any = 1) -> Tensor:
        self._check_write("index_add_")
        return self._assign(self.index_add(dim, index, source, alpha=alpha), "index_add_")

    def index_copy(self, dim: _int, index: Tensor, source: Tensor) -> Tensor:
        """torch's: this tensor with source's slices written at `index` along `dim` (where indices repeat, one of the
        writes is kept)."""
        return self._op("indexcopy", self._index_copy_args(dim, index, source, "index_copy"), self.shape, self.dtype,
                        [self, index, source])

    def index_copy_(self, dim: _int, index: Tensor, source: Tensor) -> Tensor:
        """In place: one instruction whose result is this tensor (a heap tensor's values change where they are)."""
        self._check_write("index_copy_")
        instr = Instr("indexcopy", self._index_copy_args(dim, index, source, "index_copy_"), (_tp(self),))
        self._s.recorder.record(instr)
        self._tape_in_place(instr, (self, source))
        return self

    def _index_copy_args(self, dim: _int, index: Tensor, source: Tensor, what: str) -> tuple[Param, ...]:
        """indexcopy's arguments, checked as torch checks them: a 1-D (or 0-d) integer index, source of this
        tensor's dtype and rank, shaped like it but for dim, where it has one slice per index."""
        if not isinstance(index, Tensor) or index.dtype not in ("int64", "int32") or index.ndim > 1:
            raise DeepxError(f"{what}: the index must be a 0-d or 1-D int64 (or int32) tensor, got "
                             f"{getattr(index, 'dtype', type(index).__name__)} {list(getattr(index, 'shape', ()))}")
        if not isinstance(source, Tensor) or source.dtype != self.dtype:  # as torch: no silent cast
            raise DeepxError(f"{what}: source is {getattr(source, 'dtype', type(source).__name__)}, '{self.name}' "
                             f"is {self.dtype}; they must match")
        if self.ndim == 0:
            raise DeepxError(f"{what}: '{self.name}' is 0-d; deepx copies slices along a dim of a tensor of rank 1 "
                             "or more (reshape it to (1,))")
        if source.ndim != self.ndim:
            raise DeepxError(f"{what}: source of shape {list(source.shape)} and '{self.name}' of shape "
                             f"{list(self.shape)} must have the same number of dims")
        d = norm_dim(what, dim, self.ndim)
        if index.ndim == 0:
            index = index.reshape(1)
        metas = [TensorMeta(self.shape, self.dtype), TensorMeta(index.shape, index.dtype),
                 TensorMeta(source.shape, source.dtype), d]
        self._infer("indexcopy", metas, [self.name, index.name, source.name, None])
        return _tp(self), _tp(index), _tp(source), Param.var(d)

    def gather(self, dim: _int, index: Tensor, *, sparse_grad: _bool = False) -> Tensor:
        """torch's: out[i][j] = self[index[i][j]][j] for dim 0 (any rank); out has index's shape."""
        index = _index_of("gather", index)
        meta = self._infer("gather", [TensorMeta(self.shape, self.dtype), TensorMeta(index.shape, index.dtype), dim],
                           [self.name, index.name, None])
        return self._op("gather", (_tp(self), _tp(index), _vp(int(dim))), meta.shape, meta.dtype, (self, index))

    def scatter(self, dim: _int, index: Tensor, src: Any = None, *, value: Any = None, reduce: str | None = None
                ) -> Tensor:
        """torch's: this tensor with src's elements (or `value`) written where index says along dim; reduce='add'
        adds them instead (scatter_add). Where indices repeat, one of the writes is kept."""
        if reduce not in (None, "add"):
            raise DeepxError(f"scatter: reduce={reduce!r} is not supported by deepx (only 'add'; scatter_reduce is "
                             "not either)")
        return self._scatter("scatteradd" if reduce == "add" else "scatter", dim, index,
                             value if src is None else src)

    def scatter_add(self, dim: _int, index: Tensor, src: Tensor) -> Tensor:
        """torch's: this tensor with src's elements added where index says along dim (repeated indices add up)."""
        return self._scatter("scatteradd", dim, index, src)

    def scatter_(self, dim: _int, index: Tensor, src: Any = None, *, value: Any = None,
                 reduce: str | None = None) -> Tensor:
        self._check_write("scatter_")
        return self._assign(self.scatter(dim, index, src, value=value, reduce=reduce), "scatter_")

    def scatter_add_(self, dim: _int, index: Tensor, src: Tensor) -> Tensor:
        self._check_write("scatter_add_")
        return self._assign(self.scatter_add(dim, index, src), "scatter_add_")

    def _scatter(self, op: str, dim: _int, index: Tensor, src: Any) -> Tensor:
        what = "scatter_add" if op == "scatteradd" else "scatter"
        index = _index_of(what, index)
        if src is None:
            raise DeepxError(f"{what}: give src (a tensor) or value (a number)")
        if not isinstance(src, Tensor):  # a number: written (or added) everywhere the index says
            src = full(index.shape, src, dtype=self.dtype)
        elif src.dtype != self.dtype:  # as torch: no silent cast
            raise DeepxError(f"{what}: src is {src.dtype}, '{self.name}' is {self.dtype}; they must match")
        if src.shape != index.shape:  # torch reads src[:index.shape] only
            if src.ndim != index.ndim or any(s < i for s, i in zip(src.shape, index.shape)):
                raise DeepxError(f"{what}: src of shape {list(src.shape)} is smaller than index {list(index.shape)}"
                                 " in some dim (or of another rank)")
            src = src[tuple(builtins.slice(0, i) for i in index.shape)]
        self._infer(op, [TensorMeta(self.shape, self.dtype), TensorMeta(index.shape, index.dtype),
                         TensorMeta(src.shape, src.dtype), dim], [self.name, index.name, src.name, None])
        return self._op(op, (_tp(self), _tp(index), _tp(src), _vp(int(dim))), self.shape, self.dtype,
                        (self, index, src))

    def __matmul__(self, o: Tensor) -> Tensor:
        return matmul(self, o)

    def __rmatmul__(self, o: Tensor) -> Tensor:
        return matmul(o, self)

    def __floordiv__(self, o: Any) -> Tensor:
        return _divmod("floordiv", self, o)

    def __rfloordiv__(self, o: Any) -> Tensor:
        return _divmod("floordiv", o, self)

    def __mod__(self, o: Any) -> Tensor:
        return _divmod("remainder", self, o)

    def __rmod__(self, o: Any) -> Tensor:
        return _divmod("remainder", o, self)

    def floor_divide(self, o: Any) -> Tensor:
        return _divmod("floordiv", self, o)

    def remainder(self, o: Any) -> Tensor:
        return _divmod("remainder", self, o)

    def fmod(self, o: Any) -> Tensor:
        return _divmod("fmod", self, o)

    # -- comparisons
    def _compare(self, op: str, other: Any, scalar_op: str) -> Tensor:
        if isinstance(other, Tensor):
            dt = result_type(self, other)
            if dt == "bool" and op not in ("equal", "notequal"):
                dt = "int8"  # less and greater have no bool kernels
            a, b = self.type_as_dtype(dt), other.type_as_dtype(dt)
            shape = broadcast(op, a.shape, b.shape, names=[a.name, b.name])
            args: tuple[Param, ...] = (_tp(a), _tp(b))
            if op in ("equal", "notequal"):
                args += (_vp(0),)
            return self._op(op, args, shape, "bool", [])
        if isinstance(other, np.generic):
            other = other.item()
        scalar_dtype(self.dtype, other)
        a = self.type_as_dtype(DEFAULT_FLOAT) if self.dtype == "bool" and op not in ("equal", "notequal") else self
        args = (_tp(a), _vp(_number(other)))
        if scalar_op in ("equalscalar", "notequalscalar"):
            args += (_vp(0),)
        return self._op(scalar_op, args, self.shape, "bool", [])

    def __lt__(self, o: Any) -> Tensor:
        return self._compare("less", o, "lessscalar")

    def __gt__(self, o: Any) -> Tensor:
        return self._compare("greater", o, "greaterscalar")

    def __le__(self, o: Any) -> Tensor:
        return self._or_equal("less", o, "lessscalar", "greater", "greaterscalar")

    def __ge__(self, o: Any) -> Tensor:
        return self._or_equal("greater", o, "greaterscalar", "less", "lessscalar")

    def _or_equal(self, op: str, o: Any, scalar_op: str, opposite: str, scalar_opposite: str) -> Tensor:
        """a <= b (a >= b): `not (a > b)` where no value can be nan; with floats, (a < b) != (a == b) (never both
        true), which is false where either is nan, as IEEE and torch have it."""
        floats = self.dtype in FLOATS or (o.dtype in FLOATS if isinstance(o, Tensor) else isinstance(o, _float))
        if not floats:
            return ~self._compare(opposite, o, scalar_opposite)
        return self._compare(op, o, scalar_op) != self._compare("equal", o, "equalscalar")

    def __eq__(self, o: Any) -> Tensor:  # type: ignore[override]
        return self._compare("equal", o, "equalscalar")

    def __ne__(self, o: Any) -> Tensor:  # type: ignore[override]
        return self._compare("notequal", o, "notequalscalar")

    __hash__ = object.__hash__

    def eq(self, o: Any) -> Tensor:
        return self == o

    def ne(self, o: Any) -> Tensor:
        return self != o

    def lt(self, o: Any) -> Tensor:
        return self < o

    def gt(self, o: Any) -> Tensor:
        return self > o

    def le(self, o: Any) -> Tensor:
        return self <= o

    def ge(self, o: Any) -> Tensor:
        return self >= o

    # -- unary math (method forms of dx.*)
    def _unary(self, op: str, floating: _bool = True) -> Tensor:
        if self.dtype in _FLOAT_RANK:  # depth 3: _op <- _unary <- the method <- its caller
            return self._op(op, (self._p or _tp(self),), self.shape, self.dtype, (self,), 3)
        a = self.type_as_dtype(DEFAULT_FLOAT) if floating else self
        return self._op(op, (_tp(a),), a.shape, a.dtype, [a])

    exp = _float_unary("exp")

    log = _float_unary("log")

    sqrt = _float_unary("sqrt")

    def rsqrt(self) -> Tensor:
        if _amp.dtype is not None and self.dtype in _HALF:
            return self.type_as_dtype("float32").rsqrt()
        return 1.0 / self.sqrt()

    sin = _float_unary("sin")

    cos = _float_unary("cos")

    tan = _float_unary("tan")

    tanh = _float_unary("tanh")

    sigmoid = _float_unary("sigmoid")

    log1p = _float_unary("log1p")

    expm1 = _float_unary("expm1")

    erf = _float_unary("erf")

    floor = _rounding("floor")

    ceil = _rounding("ceil")

    trunc = fix = _rounding("trunc")

    def round(self, decimals: _int = 0) -> Tensor:
        """To the nearest whole number, halves to even; with `decimals`, as torch computes it: round(x * 10^d) / 10^d
        (d < 0: round(x / 10^-d) * 10^-d)."""
        if not decimals:
            if self.dtype not in _FLOAT_RANK:
                return self.clone()
            return self._op("round", (_tp(self),), self.shape, self.dtype, (self,))
        if self.dtype not in _FLOAT_RANK:
            raise DeepxError(f"round: decimals={decimals} needs a float tensor; '{self.name}' is {self.dtype} (torch "
                             "refuses it too)")
        scale = 10.0 ** builtins.abs(decimals)
        return (self * scale).round() / scale if decimals > 0 else (self / scale).round() * scale

    def frac(self) -> Tensor:
        """x - trunc(x), the sign of x kept (its gradient is g, as torch's)."""
        return self - self.trunc()

    def relu(self) -> Tensor:
        if self.dtype in _FLOAT_RANK and not self.requires_grad:  # recorded straight away, as _float_unary does
            return _emit(self._s, "relu", (self._p or _tp(self),), self.shape, self.dtype, 2)
        if self.dtype not in _FLOAT_RANK:
            return self.clamp(min=0)
        return self._unary("relu")

    def abs(self) -> Tensor:
        return self._unary("abs", floating=False)

    def neg(self) -> Tensor:
        return -self

    def square(self) -> Tensor:
        return self * self

    def pow(self, e: Any) -> Tensor:
        if _amp.dtype is not None and self.dtype in _HALF:
            return self.type_as_dtype("float32") ** e
        return self ** e

    def clamp(self, min: Any = None, max: Any = None) -> Tensor:  # torch's names, shadowing builtins
        """As torch's: a number bound is maxscalar/minscalar (the gradient passes at the bound); a tensor bound is a
        where, so that at a tie the gradient goes to this tensor, as torch's clamp gives it (maximum would split it),
        and a NaN here stays NaN."""
        out = self
        if min is not None:
            out = where(out < min, min, out) if isinstance(min, Tensor) else out._binary("max", min, "maxscalar")
        if max is not None:
            out = where(out > max, max, out) if isinstance(max, Tensor) else out._binary("min", max, "minscalar")
        return out

    clip = clamp

    def maximum(self, o: Tensor) -> Tensor:
        return self._binary("max", o, "maxscalar")

    def minimum(self, o: Tensor) -> Tensor:
        return self._binary("min", o, "minscalar")

    def softmax(self, dim: _int = -1) -> Tensor:
        a = self._unary_cast()
        if _amp.dtype is not None and a.dtype in _HALF:
            a = a.type_as_dtype("float32")
        norm_dim("softmax", dim, a.ndim, scalar_ok=True)
        return a._op("softmax", (_tp(a), _vp(int(dim))), a.shape, a.dtype, [a])

    def log_softmax(self, dim: _int = -1) -> Tensor:
        a = self._unary_cast()
        if _amp.dtype is not None and a.dtype in _HALF:
            a = a.type_as_dtype("float32")
        norm_dim("log_softmax", dim, a.ndim, scalar_ok=True)
        return a._op("logsoftmax", (_tp(a), _vp(int(dim))), a.shape, a.dtype, [a])

    def _unary_cast(self) -> Tensor:
        return self.type_as_dtype(DEFAULT_FLOAT) if self.dtype not in _FLOAT_RANK else self

    # -- reductions
    def _dims(self, dim: Any) -> tuple[_int, ...]:
        if dim is None:
            return ()
        if isinstance(dim, _int):
            return (dim,)
        return tuple(dim)

    def _reduce(self, op: str, dim: Any, keepdim: _bool, dtype: str | None = None) -> Tensor:
        a = self.type_as_dtype(dtype) if dtype else self
        if op in ("sum", "prod") and a.dtype in ("bool", "int8", "int16", "int32"):
            a = a.type_as_dtype("int64")  # torch sums and multiplies small integers in int64
        # remembered only for plain ints (a key holding a Tensor would compare by recording an op)
        simple = (dim is None or type(dim) is int or (type(dim) in (tuple, list) and all(type(d) is int for d in dim))
                  ) and type(keepdim) is bool
        key = (op, a.shape, a.dtype, dim if type(dim) is not list else tuple(dim), keepdim) if simple else None
        known = _REDUCTIONS.get(key) if simple else None
        if known is None:
            dims = self._dims(dim)
            meta = self._infer(op, [TensorMeta(a.shape, a.dtype), dims, keepdim], [a.name, None, None])
            known = (meta.shape, meta.dtype, _vec(dims), _vp(bool(keepdim)))
            if key is not None:
                _REDUCTIONS.put(key, known)
        shape, dt, pdims, pkeep = known
        return a._op(op, (_tp(a), pdims, pkeep), shape, dt, (a,))

    def sum(self, dim: Any = None, keepdim: _bool = False, dtype: Any = None) -> Tensor:
        if _amp.dtype is not None and self.dtype in _HALF and dtype is None:
            return self.type_as_dtype("float32").sum(dim, keepdim)
        if dtype is None and (dim is None or type(dim) is int) and not self.requires_grad:
            known = _REDUCTIONS.get(("sum", self.shape, self.dtype, dim, keepdim))  # as _reduce remembered it
            if known is not None:
                return _emit(self._s, "sum", (self._p or _tp(self), known[2], known[3]), known[0], known[1], 2)
        return self._reduce("sum", dim, keepdim, dtype_name(dtype) if dtype is not None else None)

    def prod(self, dim: Any = None, keepdim: _bool = False) -> Tensor:
        if _amp.dtype is not None and self.dtype in _HALF:
            return self.type_as_dtype("float32").prod(dim, keepdim)
        return self._reduce("prod", dim, keepdim)

    def mean(self, dim: Any = None, keepdim: _bool = False) -> Tensor:
        a = self._unary_cast()
        dims = self._dims(dim)
        count = numel(a.shape) if not dims else math.prod(a.shape[norm_dim("mean", d, a.ndim)] for d in dims)
        return a._reduce("sum", dim, keepdim) / count

    def var(self, dim: Any = None, keepdim: _bool = False, unbiased: _bool = True,
            correction: _int | None = None) -> Tensor:
        a = self._unary_cast()
        dims = self._dims(dim)
        n = numel(a.shape) if not dims else math.prod(a.shape[norm_dim("var", d, a.ndim)] for d in dims)
        c = (1 if unbiased else 0) if correction is None else correction
        centered = a - a.mean(dim, keepdim=True)
        return (centered * centered).sum(dim, keepdim=keepdim) / builtins.max(n - c, 0)

    def std(self, dim: Any = None, keepdim: _bool = False, unbiased: _bool = True) -> Tensor:
        return _sqrt_zero_grad(self.var(dim, keepdim=keepdim, unbiased=unbiased))

    def max(self, dim: Any = None, keepdim: _bool = False) -> Any:
        if isinstance(dim, Tensor):
            return self.maximum(dim)
        if dim is None:
            return self._reduce("reducemax", None, False)
        return _ValuesIndices(self._reduce("reducemax", dim, keepdim), self.argmax(dim, keepdim))

    def min(self, dim: Any = None, keepdim: _bool = False) -> Any:
        if isinstance(dim, Tensor):
            return self.minimum(dim)
        if dim is None:
            return self._reduce("reducemin", None, False)
        return _ValuesIndices(self._reduce("reducemin", dim, keepdim), self.argmin(dim, keepdim))

    def amax(self, dim: Any = None, keepdim: _bool = False) -> Tensor:
        return self._reduce("reducemax", dim, keepdim)

    def amin(self, dim: Any = None, keepdim: _bool = False) -> Tensor:
        return self._reduce("reducemin", dim, keepdim)

    def _arg(self, op: str, dim: _int | None, keepdim: _bool) -> Tensor:
        a = self if dim is not None else self.reshape(-1)
        d = 0 if dim is None else dim
        meta = self._infer(op, [TensorMeta(a.shape, a.dtype), d, keepdim], [a.name, None, None])
        return a._op(op, (_tp(a), _vp(int(d)), _vp(bool(keepdim))), meta.shape, "int64", [])

    def cumsum(self, dim: _int, *, dtype: Any = None) -> Tensor:
        """Running sums along dim; integer and bool tensors sum in int64, as torch's (`dtype`: cast first)."""
        a = self.type_as_dtype(dtype_name(dtype)) if dtype is not None else self
        if _amp.dtype is not None and a.dtype in _HALF:
            a = a.type_as_dtype("float32")
        if a.dtype in ("bool", "int8", "int16", "int32"):
            a = a.type_as_dtype("int64")
        meta = a._infer("cumsum", [TensorMeta(a.shape, a.dtype), dim, False], [a.name, None, None])
        return a._op("cumsum", (_tp(a), _vp(int(dim))), meta.shape, meta.dtype, (a,))

    def cumprod(self, dim: _int, *, dtype: Any = None) -> Tensor:
        """Running products along dim; integer and bool tensors multiply in int64, as torch's (`dtype`: cast
        first)."""
        a = self.type_as_dtype(dtype_name(dtype)) if dtype is not None else self
        if _amp.dtype is not None and a.dtype in _HALF:
            a = a.type_as_dtype("float32")
        if a.dtype in ("bool", "int8", "int16", "int32"):
            a = a.type_as_dtype("int64")
        meta = a._infer("cumprod", [TensorMeta(a.shape, a.dtype), dim], [a.name, None])
        return a._op("cumprod", (_tp(a), _vp(int(dim))), meta.shape, meta.dtype, (a,))

    def kthvalue(self, k: _int, dim: _int = -1, keepdim: _bool = False) -> Any:
        """(values, indices) of the k-th smallest along dim, as torch.kthvalue's (nan the largest; among equal values
        the first in order, where torch may name any of them)."""
        if self.ndim == 0:
            if k != 1:
                raise DeepxError(f"kthvalue: k ({k}) out of range for a tensor of one element")
            return _ValuesIndices(self.clone(), full((), 0, dtype="int64"))
        d = norm_dim("kthvalue", dim, self.ndim)
        if not 1 <= k <= self.shape[d]:
            raise DeepxError(f"kthvalue: k ({k}) out of range: dim {dim} of '{self.name}' has {self.shape[d]} "
                             "elements")
        at = tuple(slice(k - 1, k) if i == d else slice(None) for i in range(self.ndim))
        return self._selected(self._argtopk(k, d, False)[at], d, keepdim)

    def median(self, dim: Any = None, keepdim: _bool = False) -> Any:
        """The lower median (the ((n - 1) // 2 + 1)-th smallest) as torch.median: of every element (a 0-d tensor)
        or (values, indices) along dim; nan where a nan is among the values (its index, the first's)."""
        if dim is None:
            flat = self.reshape(-1)
            if flat.numel() == 0:
                raise DeepxError("median: the input is empty; median() of no values is undefined, as in torch")
            return flat.median(0).values
        d = norm_dim("median", dim, max(self.ndim, 1))
        if self.ndim == 0:
            return self.kthvalue(1, 0, keepdim)
        n = self.shape[d]
        if n == 0:
            raise DeepxError(f"median: dim {dim} of '{self.name}' is empty")
        at = tuple(slice((n - 1) // 2, (n - 1) // 2 + 1) if i == d else slice(None) for i in range(self.ndim))
        index = self._argtopk((n - 1) // 2 + 1, d, False)[at]
        if self.dtype in FLOATS:
            nan = self.isnan()
            first_nan = nan.type_as_dtype("int8").argmax(d, keepdim=True)
            index = where(nan.any(d, keepdim=True), first_nan, index)
        return self._selected(index, d, keepdim)

    def _selected(self, index: Tensor, dim: _int, keepdim: _bool) -> Any:
        """(values, indices) of one index per slice along dim (index of size 1 there), its gradient to the element
        picked."""
        values = self.gather(dim, index)
        if not keepdim:
            values, index = values.squeeze(dim), index.squeeze(dim)
        return _ValuesIndices(values, index)

    def argsort(self, dim: _int = -1, descending: _bool = False, stable: _bool = False) -> Tensor:
        """The indices that sort along dim; always stable (ties keep their order, as torch's stable=True), nan the
        largest."""
        a = self if self.dtype != "bool" else self.type_as_dtype("int8")
        meta = a._infer("argsort", [TensorMeta(a.shape, a.dtype), dim, descending], [a.name, None, None])
        return a._op("argsort", (_tp(a), _vp(int(dim)), _vp(bool(descending))), meta.shape, "int64", [])

    def sort(self, dim: _int = -1, descending: _bool = False, stable: _bool = False) -> Any:
        """(values, indices) as torch.sort's, always stable; the values are gathered by the indices, so their
        gradient goes back to where each came from."""
        indices = self.argsort(dim, descending)
        return _ValuesIndices(self.gather(dim, indices), indices)

    def topk(self, k: _int, dim: _int = -1, largest: _bool = True, sorted: _bool = True) -> Any:
        """(values, indices) of the k largest (or smallest) along dim, as torch.topk's; always sorted, ties to the
        first index."""
        indices = self._argtopk(k, dim, largest)
        return _ValuesIndices(self.gather(dim, indices), indices)

    def _argtopk(self, k: _int, dim: _int, largest: _bool) -> Tensor:
        a = self if self.dtype != "bool" else self.type_as_dtype("int8")
        meta = a._infer("argtopk", [TensorMeta(a.shape, a.dtype), int(k), dim, largest], [a.name, None, None, None])
        return a._op("argtopk", (_tp(a), _vp(int(k)), _vp(int(dim)), _vp(bool(largest))), meta.shape, "int64", [])

    def argmax(self, dim: _int | None = None, keepdim: _bool = False) -> Tensor:
        return self._arg("argmax", dim, keepdim)

    def argmin(self, dim: _int | None = None, keepdim: _bool = False) -> Tensor:
        return self._arg("argmin", dim, keepdim)

    def all(self, dim: Any = None, keepdim: _bool = False) -> Tensor:
        if dim is None:
            return self.bool().long().sum() == self.numel()
        dims = (dim,) if isinstance(dim, _int) else tuple(dim)
        n = 1
        for d in dims:
            n *= self.shape[norm_dim("all", d, self.ndim)]
        return self.bool().long().sum(dims, keepdim=keepdim) == n

    def any(self, dim: Any = None, keepdim: _bool = False) -> Tensor:
        if dim is None:
            return self.bool().long().sum() > 0
        return self.bool().long().sum(dim, keepdim=keepdim) > 0

    def isnan(self) -> Tensor:
        return self != self

    def isinf(self) -> Tensor:
        if self.dtype not in FLOATS:
            return full(self.shape, False, dtype="bool")
        return self.abs() == math.inf

    def isfinite(self) -> Tensor:
        if self.dtype not in FLOATS:
            return full(self.shape, True, dtype="bool")
        return (self - self) == 0  # inf - inf and nan - nan are nan

    def cpu(self) -> Tensor:
        return self  # model code never names a device: the daemon places tensors

    def is_contiguous(self, memory_format: Any = None) -> _bool:
        return True

    def new_zeros(self, *size: Any, dtype: Any = None, requires_grad: _bool = False) -> Tensor:
        return zeros(*size, dtype=dtype or self.dtype, requires_grad=requires_grad)

    def new_ones(self, *size: Any, dtype: Any = None, requires_grad: _bool = False) -> Tensor:
        return ones(*size, dtype=dtype or self.dtype, requires_grad=requires_grad)

    def new_empty(self, *size: Any, dtype: Any = None, requires_grad: _bool = False) -> Tensor:
        return empty(*size, dtype=dtype or self.dtype, requires_grad=requires_grad)

    def new_full(self, size: Any, fill_value: Any, dtype: Any = None, requires_grad: _bool = False) -> Tensor:
        return full(size, fill_value, dtype=dtype or self.dtype, requires_grad=requires_grad)

    def new_tensor(self, data: Any, dtype: Any = None, requires_grad: _bool = False) -> Tensor:
        return tensor(data, dtype=dtype or self.dtype, requires_grad=requires_grad)

    def split(self, split_size_or_sections: Any, dim: _int = 0) -> tuple[Tensor, ...]:
        """Pieces along dim: of split_size each (the last smaller), or of the given sizes, as torch.split."""
        d = norm_dim("split", dim, self.ndim)
        size = self.shape[d]
        if isinstance(split_size_or_sections, _int):
            step = split_size_or_sections
            if step <= 0:
                raise DeepxError(f"split: split_size must be positive, got {step}")
            sizes = [min(step, size - i) for i in range(0, size, step)] or [0]
        else:
            sizes = [int(k) for k in split_size_or_sections]
            if sum(sizes) != size or any(k < 0 for k in sizes):
                raise DeepxError(f"split: sizes {sizes} do not add up to {size}, the size of dim {dim} of "
                                 f"'{self.name}' {self.shape}")
        out, start = [], 0
        for k in sizes:
            index = (slice(None),) * d + (slice(start, start + k),)
            out.append(self[index])
            start += k
        return tuple(out)

    def chunk(self, chunks: _int, dim: _int = 0) -> tuple[Tensor, ...]:
        """At most `chunks` pieces along dim, each of ceil(size / chunks), as torch.chunk."""
        if chunks <= 0:
            raise DeepxError(f"chunk: chunks must be positive, got {chunks}")
        size = self.shape[norm_dim("chunk", dim, self.ndim)]
        return self.split(max(-(-size // chunks), 1), dim)

    def unbind(self, dim: _int = 0) -> tuple[Tensor, ...]:
        d = norm_dim("unbind", dim, self.ndim)
        return tuple(self[(slice(None),) * d + (i,)] for i in range(self.shape[d]))

    # -- shape
    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        # remembered only for plain ints (a key holding a Tensor would compare by recording an op)
        key: Any = (self.shape, shape)
        for d in shape:  # a loop, not all(...): this runs for every reshape
            if type(d) is not int:
                key = None
                break
        known = _RESHAPES.get(key) if key is not None else None
        if known is None:
            meta = self._infer("reshape", [TensorMeta(self.shape, self.dtype), tuple(int(d) for d in shape)],
                               [self.name, None])
            known = (meta.shape, _vec(shape))
            if key is not None:
                _RESHAPES.put(key, known)
        if known[0] == self.shape:
            return self
        if not self.requires_grad:
            out = _emit(self._s, "reshape", (self._p or _tp(self), known[1]), known[0], self.dtype, 2)
        else:
            out = self._op("reshape", (_tp(self), known[1]), known[0], self.dtype, (self,))
        return _viewed(out, self)

    view = reshape

    def view_as(self, other: Tensor) -> Tensor:
        return self.reshape(other.shape)

    def reshape_as(self, other: Tensor) -> Tensor:
        return self.reshape(other.shape)

    def flatten(self, start_dim: _int = 0, end_dim: _int = -1) -> Tensor:
        if self.ndim == 0:
            return self.reshape(1)
        s = norm_dim("flatten", start_dim, self.ndim)
        e = norm_dim("flatten", end_dim, self.ndim)
        return self.reshape(*self.shape[:s], -1, *self.shape[e + 1:])

    def permute(self, *dims: Any) -> Tensor:
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        meta = self._infer("transpose", [TensorMeta(self.shape, self.dtype), tuple(dims)], [self.name, None])
        if tuple(d % builtins.max(self.ndim, 1) for d in dims) == tuple(range(self.ndim)):
            return self
        # a transpose is a view in the daemon (deepxd/kernels/cpu): once collected its name is deleted as well as
        # pooled, so that it does not outlive, as a copy, the next in-place write of its operand (an optimizer's)
        out = self._op("transpose", (_tp(self), _vec(d % self.ndim for d in dims)), meta.shape, self.dtype, [self],
                       deleted=True)
        return _viewed(out, self)

    def transpose(self, dim0: _int, dim1: _int) -> Tensor:
        order = list(range(self.ndim))
        a, b = norm_dim("transpose", dim0, self.ndim), norm_dim("transpose", dim1, self.ndim)
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    def t(self) -> Tensor:
        shape = self.shape
        if len(shape) == 2:  # every Linear's weight, every step: straight to the instruction
            out = self._op("transpose", (self._p or _tp(self), _SWAP), (shape[1], shape[0]), self.dtype, [self],
                           deleted=True)  # a view in the daemon: see permute
            return _viewed(out, self)
        if self.ndim > 2:
            raise DeepxError(f"t(): '{self.name}' has {self.ndim} dims; use transpose or mT")
        return self

    @property
    def T(self) -> Tensor:  # torch's name
        return self.permute(list(range(self.ndim))[::-1])

    @property
    def mT(self) -> Tensor:  # torch's name
        return self.transpose(-2, -1)

    def squeeze(self, dim: Any = None) -> Tensor:
        if dim is None:
            return self.reshape([d for d in self.shape if d != 1])
        dims = {norm_dim("squeeze", k, self.ndim) for k in ((dim,) if isinstance(dim, _int) else dim)}
        shape = tuple(n for i, n in enumerate(self.shape) if not (i in dims and n == 1))
        return self if shape == self.shape else self.reshape(shape)

    def unsqueeze(self, dim: _int) -> Tensor:
        d = norm_dim("unsqueeze", dim, self.ndim + 1)
        return self.reshape((*self.shape[:d], 1, *self.shape[d:]))

    def expand(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        target = list(shape)
        lead = len(target) - self.ndim
        for i, d in enumerate(target):
            if d == -1:
                target[i] = self.shape[i - lead]
        new = tuple(int(d) for d in target)
        if new == self.shape:
            return self
        meta = self._infer("broadcastTo", [TensorMeta(self.shape, self.dtype), new], [self.name, None])
        return _viewed(self._op("broadcastTo", (_tp(self), _vec(new)), meta.shape, self.dtype, [self]), self)

    def expand_as(self, other: Tensor) -> Tensor:
        return self.expand(other.shape)

    def repeat(self, *reps: Any) -> Tensor:
        if len(reps) == 1 and isinstance(reps[0], (tuple, list)):
            reps = tuple(reps[0])
        meta = self._infer("repeat", [TensorMeta(self.shape, self.dtype), tuple(reps)], [self.name, None])
        return self._op("repeat", (_tp(self), _vec(reps)), meta.shape, self.dtype, [self])

    def contiguous(self) -> Tensor:
        """This tensor. A view's stays marked (see _check_write): torch's contiguous() is the view itself or a
        copy depending on strides deepx does not keep (`(x.t() + 1).t()` is contiguous there), so writing it is
        refused rather than guessed; `.clone()` it to write a copy."""
        return self

    def clone(self) -> Tensor:
        return self._op("copytensor", (_tp(self),), self.shape, self.dtype, [self])

    def detach(self) -> Tensor:
        """A copy that does not require grad (torch's shares memory: see _check_write)."""
        return _viewed(self._copy(), self)

    def _copy(self) -> Tensor:
        """A new tensor holding this one's values, not requiring grad."""
        out = Tensor(self._s.names.new_name(), self.shape, self.dtype, self._s)
        self._s.recorder.record(Instr("copytensor", (_tp(self),), (Param("tensor", (self.dtype,), out.name),)))
        return out

    def __copy__(self) -> Tensor:
        raise DeepxError("copy.copy of a deepx tensor: torch's shares the storage, which a second deepx handle cannot "
                         "do under autograd; use .clone() for a copy of the values, .data for a second handle, or "
                         "copy.deepcopy")

    def __deepcopy__(self, memo: dict[_int, Any]) -> Tensor:
        """A new daemon tensor with this one's values, requires_grad and (copied) .grad, as torch's deepcopy of a
        leaf (copy.deepcopy of a model with buffers walked into the session and failed on its event loop)."""
        if self.grad_fn is not None:
            raise DeepxError(f"deepcopy: '{self.name}' was computed by an op inside autograd; only tensors created "
                             "by the user (graph leaves) can be deep-copied, as in torch: deepcopy its detach()")
        out = self._copy()
        out.requires_grad = self.requires_grad
        return self._deepcopied(out, memo)

    def _deepcopied(self, out: Tensor, memo: dict[_int, Any]) -> Tensor:
        """A deep copy's last part (a Parameter's too): .grad copied as well, as torch's deepcopy does."""
        if self.grad is not None:
            out.grad = self.grad.__deepcopy__(memo)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise DeepxError("a deepx Tensor cannot be pickled (its values live in the daemon); use dx.save, or "
                         ".numpy() for its values")

    @property
    def data(self) -> Tensor:
        """This tensor's values without its autograd history, as torch's `.data`: a second handle on the same daemon
        tensor that does not require grad. Writing it in place (`p.data.mul_(0.5)`) writes this tensor, unseen by
        autograd; the handle keeps this one (and so the name) alive, and never deletes the name itself."""
        out = _new_object(Tensor)
        out.name, out.shape, out.dtype, out._s = self.name, self.shape, self.dtype, self._s
        out.requires_grad = False
        out.grad = out.grad_fn = out._p = None
        out._k = False
        out._o = self
        if type(self) is not Tensor:  # a parameter, whose name may change (see data_handles)
            _note_handle(self, out)
        ref = getattr(self, "_b", None)
        if ref is not None:  # a view's .data is that view's copy
            out._b = ref
        return out

    @data.setter
    def data(self, value: Any) -> None:
        src = value if isinstance(value, Tensor) else tensor(value, dtype=self.dtype)
        if src.shape != self.shape:
            raise DeepxError(f"'{self.name}'.data = ...: shape {src.shape} differs from {self.shape}; deepx cannot "
                             "change a tensor's shape in place")
        with _no_tape(self._s):
            self._assign(src)

    def requires_grad_(self, flag: _bool = True) -> Tensor:
        if flag and self.dtype not in FLOATS:
            raise DeepxError(f"requires_grad_: only floating-point tensors can require gradients; '{self.name}' is "
                             f"{self.dtype}")
        if not flag and self.grad_fn is not None:
            raise DeepxError(f"requires_grad_(False): '{self.name}' is not a leaf (it was computed from tensors that "
                             "require grad); use .detach() for a copy that does not")
        self.requires_grad = flag
        return self

    # -- masks and sampling
    def _triangle(self, op: str, diagonal: _int, lower: _bool) -> Tensor:
        if self.ndim < 2:
            raise DeepxError(f"{op}: '{self.name}' has {self.ndim} dims; {op} needs a matrix or a batch of them")
        rows, cols = self.shape[-2:]
        offset = arange(cols) - arange(rows).unsqueeze(-1)  # column minus row, (rows, cols)
        keep = offset <= int(diagonal) if lower else offset >= int(diagonal)
        return where(keep, self, full((), 0, dtype=self.dtype))

    def tril(self, diagonal: _int = 0) -> Tensor:
        """The lower triangle of the last two dims (j - i <= diagonal); the rest zeros, as torch.tril."""
        return self._triangle("tril", diagonal, lower=True)

    def triu(self, diagonal: _int = 0) -> Tensor:
        """The upper triangle of the last two dims (j - i >= diagonal); the rest zeros, as torch.triu."""
        return self._triangle("triu", diagonal, lower=False)

    def masked_fill(self, mask: Tensor, value: Any) -> Tensor:
        """`value` where the bool `mask` (broadcast to this tensor's shape) is True; this tensor's dtype is kept."""
        if not isinstance(mask, Tensor) or mask.dtype != "bool":
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise DeepxError(f"masked_fill: the mask must be a bool tensor, got {got} (compare first: x == 0)")
        shape = broadcast("masked_fill", self.shape, mask.shape, names=[self.name, mask.name])
        if shape != self.shape:
            raise DeepxError(f"masked_fill: mask '{mask.name}' of shape {mask.shape} does not broadcast to "
                             f"'{self.name}' of shape {self.shape}")
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise DeepxError(f"masked_fill: value must be a number or a 1-element tensor, got shape "
                                 f"{value.shape}")
            fill = value.reshape(()).type_as_dtype(self.dtype)
        else:
            fill = full((), value, dtype=self.dtype)
        return where(mask, fill, self)

    def masked_fill_(self, mask: Tensor, value: Any) -> Tensor:
        self._check_write("masked_fill_")
        return self._assign(self.masked_fill(mask, value), "masked_fill_")

    def multinomial(self, num_samples: _int, replacement: _bool = False) -> Tensor:
        """Indices drawn from the categories of the last dim, with probabilities proportional to the (non-negative)
        weights, as torch.multinomial; by the Gumbel-max trick, so everything stays on the daemon."""
        if self.ndim not in (1, 2):
            raise DeepxError(f"multinomial: '{self.name}' must be 1-D or 2-D (weights per category), got {self.shape}")
        n, k = self.shape[-1], int(num_samples)
        if k < 1:
            raise DeepxError(f"multinomial: num_samples must be at least 1, got {k}")
        if not replacement and k > n:
            raise DeepxError(f"multinomial: cannot draw {k} samples without replacement from {n} categories")
        logw = self._unary_cast().detach().log()
        if replacement:
            noise_shape = (*self.shape[:-1], k, n)
            scores = logw.unsqueeze(-2) - (-rand(noise_shape, dtype=logw.dtype).log()).log()
            return scores.argmax(-1)
        # Gumbel top-k: the k best perturbed scores are a sample without replacement, in the order drawn
        scores = logw - (-rand(self.shape, dtype=logw.dtype).log()).log()
        return scores._argtopk(k, -1, True)

    # -- indexing
    def __getitem__(self, index: Any) -> Tensor:
        from deepx_sdk.indexing import getitem

        return getitem(self, index)

    def __setitem__(self, index: Any, value: Any) -> None:
        from deepx_sdk.indexing import setitem

        setitem(self, index, value)

    # -- in place
    def _check_write(self, how: str) -> None:
        """Refuse an in-place write of a view's result while the tensor it came from lives: torch would write that
        tensor too, deepx's copy would not, and the difference would go unnoticed. `_b` holds every tensor the
        view shares memory with in torch (its base, that one's bases, a `.data` handle's owner): the write is
        refused while any of them lives. Views outside autograd are marked, and an index's result always: a
        reshape or transpose that requires grad is held by the graph's nodes, as its base is, for as long as the
        graph lives, so that every in-place write in a training step (ReLU(inplace=True) after a view) would be
        refused; there the write goes to the copy, as before."""
        refs = getattr(self, "_b", None)
        if refs is None:
            return
        for ref in refs:
            base = ref()
            if base is None:
                continue
            raise DeepxError(f"{how}: '{self.name}' was made from '{base.name}' by a view (reshape, view, transpose, "
                             "t, an index, expand, detach...), which in deepx is a copy: writing it in place would not "
                             f"change '{base.name}' as it would in torch. Write '{base.name}' itself (x[i] = v, "
                             "x.copy_(...), or under dx.no_grad()), or .clone() the view first to change only the copy")

    def _assign(self, other: Tensor, how: str = "in-place write") -> Tensor:
        """Make this handle hold `other`'s values (in place, as torch's x.op_() does)."""
        self._check_write(how)
        if other.shape != self.shape:
            other = other.expand(self.shape)
        other = other.type_as_dtype(self.dtype)
        instr = Instr("copytensor", (_tp(other),), (_tp(self),))
        self._s.recorder.record(instr)
        self._tape_in_place(instr, (other,))
        return self

    def _tape_in_place(self, instr: Instr, inputs: tuple[Tensor, ...]) -> None:
        """Put an in-place write of this tensor on the autograd tape, so that backward sees the new value (and the
        values it read); a leaf that requires grad is left off, as torch refuses to write one in place."""
        s = self._s
        if s.grad_enabled and self.dtype in FLOATS and (self.requires_grad or any(t.requires_grad for t in inputs)) \
                and not (self.requires_grad and self.grad_fn is None):
            self.requires_grad = True
            s.tape.append((instr, self, inputs))
        else:  # under no_grad, or a leaf: a graph that read the old value must not take the new one for it
            s.tape.wrote(self)

    def _update(self, result: Tensor, how: str) -> Tensor:
        """An in-place arithmetic update: as torch, refused where the result's dtype cannot be cast back to this
        tensor's (a float result into an integer or bool tensor)."""
        if result.dtype != self.dtype and self.dtype not in FLOATS and result.dtype in FLOATS:
            raise DeepxError(f"{how}: the result type {result.dtype} can't be cast to '{self.name}''s dtype "
                             f"{self.dtype}")
        return self._assign(result, how)

    def add_(self, o: Any, alpha: Any = 1) -> Tensor:
        self._check_write("add_")
        return self._update(self + (o * alpha if alpha != 1 else o), "add_")

    def sub_(self, o: Any, alpha: Any = 1) -> Tensor:
        self._check_write("sub_")
        return self._update(self - (o * alpha if alpha != 1 else o), "sub_")

    def mul_(self, o: Any) -> Tensor:
        self._check_write("mul_")
        return self._update(self * o, "mul_")

    def div_(self, o: Any) -> Tensor:
        self._check_write("div_")
        return self._update(self / o, "div_")

    # `x += y` writes x in place, as torch's does (a parameter's update under no_grad, a gradient scaled by hand)
    __iadd__ = add_
    __isub__ = sub_
    __imul__ = mul_
    __itruediv__ = div_

    def __ipow__(self, o: Any) -> Tensor:  # type: ignore[misc]  # (pow's operand types are _arith's)
        self._check_write("pow_")
        return self._update(self ** o, "pow_")

    pow_ = __ipow__

    def _fill(self, instr: Instr, how: str) -> Tensor:
        """An in-place fill: on the tape when this tensor is in the graph, so that backward sees the value end."""
        self._check_write(how)
        self._s.recorder.record(instr)
        self._tape_in_place(instr, ())
        return self

    def zero_(self) -> Tensor:
        return self._fill(Instr("constant", (_vp(0),), (_tp(self),)), "zero_")

    def fill_(self, value: Any) -> Tensor:
        return self._fill(Instr("constant", (_vp(_number(value)),), (_tp(self),)), "fill_")

    def copy_(self, src: Tensor) -> Tensor:
        return self._assign(src, "copy_")

    def uniform_(self, a: _float = 0.0, b: _float = 1.0) -> Tensor:
        return self._fill(Instr("uniform", (_vp(float(a)), _vp(float(b)), _vp(_seed(self._s))), (_tp(self),)),
                          "uniform_")

    def normal_(self, mean: _float = 0.0, std: _float = 1.0) -> Tensor:
        return self._fill(Instr("normal", (_vp(float(mean)), _vp(float(std)), _vp(_seed(self._s))),
                                (_tp(self),)), "normal_")


# id(leaf) -> (a weak reference to it, the hooks called after backward accumulated its .grad)
_GRAD_HOOKS: dict[_int, tuple[Any, list[Any]]] = {}


def _hooks_gone(key: _int) -> Any:
    return lambda _ref: _GRAD_HOOKS.pop(key, None)


def _after_accumulate(leaves: Iterable[Tensor]) -> None:
    for leaf in leaves:
        entry = _GRAD_HOOKS.get(id(leaf))
        if entry is not None and entry[0]() is leaf:
            for hook in list(entry[1]):
                hook(leaf)


class _HookHandle:
    """What register_post_accumulate_grad_hook returns (torch's RemovableHandle)."""

    def __init__(self, hooks: list[Any], hook: Any) -> None:
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


class _no_tape:
    """Record without gradient tracking (as dx.no_grad, for the SDK's own bookkeeping)."""

    def __init__(self, s: Session) -> None:
        self.s = s

    def __enter__(self) -> None:
        self.before = self.s.grad_enabled
        self.s.grad_enabled = False

    def __exit__(self, *exc: Any) -> None:
        self.s.grad_enabled = self.before


class _ValuesIndices(tuple):
    """torch's (values, indices) pair from max(dim), min(dim), sort and topk."""

    def __new__(cls, values: Tensor, indices: Tensor) -> _ValuesIndices:
        return super().__new__(cls, (values, indices))

    @property
    def values(self) -> Tensor:
        return self[0]

    @property
    def indices(self) -> Tensor:
        return self[1]


def _torch_only(name: str) -> property:
    def missing(self: Tensor) -> Any:
        raise DeepxAttributeError(f"Tensor.{name} is not supported by deepx (no op in its catalogue computes it); "
                                  "`deepxctl ops catalogue` lists the ops there are")

    return property(missing)


# a property each, not a __getattr__ (which would slow every attribute read of a Tensor): reading one raises a
# DeepxError that is an AttributeError, so hasattr() answers False
def _set_composites() -> None:
    """torch methods written with the ops above (deepx_sdk/composite.py: flip, roll, einsum's kin...)."""
    from deepx_sdk.composite import METHODS

    for name, fn in METHODS.items():
        setattr(Tensor, name, fn)


_set_composites()

#: torch's other names for methods deepx has
_ALIASES = {"absolute": "abs", "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le",
            "not_equal": "ne", "negative": "neg", "multiply": "mul", "subtract": "sub", "divide": "div",
            "true_divide": "div", "swapaxes": "transpose", "swapdims": "transpose", "nelement": "numel",
            "ndimension": "dim"}
#: in-place forms torch has whose meaning is not "this tensor gets the method's result": left unsupported
_NOT_IN_PLACE = frozenset({"as_strided_", "detach_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapaxes_",
                           "swapdims_", "resize_", "set_", "share_memory_"})


def _in_place(name: str) -> Callable[..., Tensor]:
    base = name[:-1]

    def method(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        self._check_write(name)
        result = getattr(self, base)(*args, **kwargs)
        if result.shape != self.shape:
            raise DeepxError(f"{name}: the result's shape {tuple(result.shape)} is not '{self.name}''s "
                             f"{tuple(self.shape)} (an in-place op keeps the tensor's shape)")
        return self._update(result, name)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"In place: this tensor gets `{base}`'s result (torch's `{name}`)."
    return method


def _set_torch_names() -> None:
    """torch's aliases of deepx's methods; `name_`, in place, for each method `name` whose result keeps the shape;
    and for every other public name of torch.Tensor (deepx_sdk/_torch_names.py), a property that raises
    DeepxAttributeError saying deepx lacks it (an AttributeError: hasattr answers False)."""
    from deepx_sdk._torch_names import TENSOR

    def method(n: str) -> _bool:
        return inspect.isfunction(inspect.getattr_static(Tensor, n, None))

    for alias, name in _ALIASES.items():
        if not hasattr(Tensor, alias):
            setattr(Tensor, alias, getattr(Tensor, name))
    for name in sorted(TENSOR):
        if inspect.getattr_static(Tensor, name, None) is not None:
            continue
        if name.endswith("_") and name not in _NOT_IN_PLACE and method(name[:-1]):
            setattr(Tensor, name, _in_place(name))
        else:
            setattr(Tensor, name, _torch_only(name))


_set_torch_names()


def _seed(s: Session) -> _int:
    """A seed for a random op: from dx.manual_seed when set (reproducible), else 0 (fresh entropy)."""
    if s.base_seed is None:
        return 0
    return (s.base_seed * 1_000_003 + next(s.seed_counter)) % (2**63 - 1) or 1


#: torch's legacy tensor type names (x.type())
_TYPE_NAMES = {"float32": "FloatTensor", "float64": "DoubleTensor", "float16": "HalfTensor",
               "bfloat16": "BFloat16Tensor", "int64": "LongTensor", "int32": "IntTensor", "int16": "ShortTensor",
               "int8": "CharTensor", "bool": "BoolTensor"}


def _hint(device: Any) -> None:
    """A factory's device=: checked (a malformed one says so), then left to the daemon, which places every tensor
    (deepx_sdk/devices.py)."""
    if device is not None:
        from deepx_sdk.devices import device as make

        make(device)


def dtype_name(dtype: Any) -> str:
    """A deepx precision name from a name, a numpy dtype, or a dx dtype constant."""
    if isinstance(dtype, str):
        to_numpy(dtype)
        return dtype
    name = getattr(dtype, "deepx_name", None)
    if name is not None:
        return str(name)
    if dtype is float:
        return DEFAULT_FLOAT
    if dtype is int:
        return DEFAULT_INT
    if dtype is bool:
        return "bool"
    try:
        return precision_of(np.dtype(dtype))
    except TypeError:
        raise DeepxError(f"unknown dtype {dtype!r}") from None


def format_tensor(values: np.ndarray, dtype: str, requires_grad: _bool = False) -> str:
    """Values the way torch prints them (torch/_tensor_str.py, default print options): tensor([...]) with the
    dtype shown when it is not float32, int64 or bool."""
    threshold, edgeitems, linewidth, precision = 1000, 3, 80, 4
    a = np.asarray(values)
    floating = dtype in FLOATS or dtype.startswith("float")
    if floating and a.dtype != np.float64:
        a = a.astype(np.float64)
    indent = len("tensor(")
    suffixes = []
    if a.size == 0:
        body = "[]"
        if a.ndim != 1:
            suffixes.append(f"size={tuple(a.shape)}")
        if dtype != "float32":
            suffixes.append(f"dtype=dx.{dtype}")
    else:
        summarize = a.size > threshold

        def summarized(x: np.ndarray) -> np.ndarray:
            if x.ndim == 0 or x.shape[0] <= 2 * edgeitems:
                return x if x.ndim <= 1 else np.stack([summarized(y) for y in x]) if len(x) else x
            if x.ndim == 1:
                return np.concatenate((x[:edgeitems], x[-edgeitems:]))
            return np.stack([summarized(y) for y in (*x[:edgeitems], *x[-edgeitems:])])

        shown = (summarized(a) if summarize else a).reshape(-1)
        fmt = _Formatter(shown, floating, precision)

        def vector(x: np.ndarray, ind: _int) -> str:
            per_line = builtins.max(1, math.floor((linewidth - ind) / (fmt.width + 2)))
            if summarize and x.shape[0] > 2 * edgeitems:
                data = [*map(fmt.format, x[:edgeitems].tolist()), " ...", *map(fmt.format, x[-edgeitems:].tolist())]
            else:
                data = [fmt.format(v) for v in x.tolist()]
            lines = [", ".join(data[i:i + per_line]) for i in range(0, len(data), per_line)]
            return "[" + (",\n" + " " * (ind + 1)).join(lines) + "]"

        def nd(x: np.ndarray, ind: _int) -> str:
            if x.ndim == 0:
                return fmt.format(x.item())
            if x.ndim == 1:
                return vector(x, ind)
            if summarize and x.shape[0] > 2 * edgeitems:
                parts = [*(nd(x[i], ind + 1) for i in range(edgeitems)), "...",
                         *(nd(x[i], ind + 1) for i in range(len(x) - edgeitems, len(x)))]
            else:
                parts = [nd(y, ind + 1) for y in x]
            return "[" + ("," + "\n" * (x.ndim - 1) + " " * (ind + 1)).join(parts) + "]"

        body = nd(a, indent)
        if dtype not in ("float32", "int64", "bool"):
            suffixes.append(f"dtype=dx.{dtype}")
    if requires_grad:
        suffixes.append("requires_grad=True")
    out = ["tensor(" + body]
    last = len(out[0]) - out[0].rfind("\n") + 1
    for sfx in suffixes:
        if last + len(sfx) + 2 > linewidth:
            out.append(",\n" + " " * indent + sfx)
            last = indent + len(sfx)
        else:
            out.append(", " + sfx)
            last += len(sfx) + 2
    return "".join(out) + ")"


class _Formatter:
    """torch's _Formatter: one width for every element; floats in int, fixed or scientific mode."""

    def __init__(self, flat: np.ndarray, floating: _bool, precision: _int) -> None:
        self.floating, self.precision = floating, precision
        self.int_mode, self.sci_mode, self.width = True, False, 1
        if not floating:
            self.width = builtins.max([1, *(len(str(v)) for v in flat.tolist())])
            return
        vals = flat[np.isfinite(flat) & (flat != 0)]
        if vals.size == 0:
            return
        absv = np.abs(vals)
        lo, hi = absv.min(), absv.max()
        self.int_mode = bool(np.all(vals == np.ceil(vals)))
        self.sci_mode = bool(hi / lo > 1000.0 or hi > 1.0e8 or lo < 1.0e-4)
        for v in vals.tolist():
            if self.sci_mode:
                n = len(f"{v:.{precision}e}")
            elif self.int_mode:
                n = len(f"{v:.0f}") + 1
            else:
                n = len(f"{v:.{precision}f}")
            self.width = builtins.max(self.width, n)

    def format(self, v: Any) -> str:
        if self.floating:
            if self.sci_mode:
                r = f"{v:{self.width}.{self.precision}e}"
            elif self.int_mode:
                r = f"{v:.0f}" + ("" if math.isinf(v) or math.isnan(v) else ".")
            else:
                r = f"{v:.{self.precision}f}"
        else:
            r = str(v)
        return (self.width - len(r)) * " " + r


# ---------------------------------------------------------------- creation


def _shape_args(shape: Sequence[Any]) -> Shape:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    out = tuple(int(d) for d in shape)
    if any(d < 0 for d in out):
        raise DeepxError(f"negative dimension in shape {list(out)}")
    return out


def _create(shape: Shape, dtype: str, requires_grad: _bool = False) -> Tensor:
    """A new tensor of zeros (newtensor makes them). It is deleted
    when Python collects it, and its name kept for reuse, as a transpose's: a loop that makes a tensor every step (a
    position index, dx.arange(T)) names it alike every step, so it sends the same program every step. Only a
    deleted name is reused here (a pooled one may name no tensor, where the passes dropped its dead value)."""
    s = session()
    name = s.recorder.freed_name(shape, dtype) if s.recorder.capture is None else s.names.new_name()
    t = Tensor(name, shape, dtype, s, requires_grad)
    if t._k is not None:
        t._k = (name, dtype, t.shape, True)
    s.recorder.record(Instr("newtensor", (_vec(shape),), (Param("tensor", (dtype,), name),)))
    return t


def empty(*shape: Any, dtype: Any = None, requires_grad: _bool = False, device: Any = None) -> Tensor:
    _hint(device)
    return _create(_shape_args(shape), dtype_name(dtype) if dtype is not None else DEFAULT_FLOAT, requires_grad)


def zeros(*shape: Any, dtype: Any = None, requires_grad: _bool = False, device: Any = None) -> Tensor:
    _hint(device)
    return empty(*shape, dtype=dtype, requires_grad=requires_grad)  # newtensor zero-fills


def full(shape: Any, fill_value: Any, dtype: Any = None, requires_grad: _bool = False, device: Any = None) -> Tensor:
    _hint(device)
    if dtype is None:
        dtype = ("bool" if isinstance(fill_value, _bool) else DEFAULT_INT if isinstance(fill_value, _int)
                 else DEFAULT_FLOAT)
    t = empty(*(shape if isinstance(shape, (tuple, list)) else (shape,)), dtype=dtype, requires_grad=requires_grad)
    if fill_value != 0:
        t._s.recorder.record(Instr("constant", (_vp(_number(fill_value)),), (_tp(t),)))
    return t


def _number(value: Any) -> Any:
    """A fill value as `constant` takes it: a number (True is 1)."""
    if isinstance(value, np.generic):
        value = value.item()
    return int(value) if isinstance(value, _bool) else value


def ones(*shape: Any, dtype: Any = None, requires_grad: _bool = False, device: Any = None) -> Tensor:
    _hint(device)
    return full(_shape_args(shape), 1, dtype=dtype or DEFAULT_FLOAT, requires_grad=requires_grad)


def arange(start: Any, end: Any = None, step: Any = 1, dtype: Any = None, device: Any = None) -> Tensor:
    _hint(device)
    if end is None:
        start, end = 0, start
    n = builtins.max(0, math.ceil((end - start) / step))
    if dtype is None:
        dtype = DEFAULT_FLOAT if any(isinstance(v, _float) for v in (start, end, step)) else DEFAULT_INT
    t = empty(n, dtype=dtype)
    t._s.recorder.record(Instr("arange", (_vp(start), _vp(step)), (_tp(t),)))
    return t


def linspace(start: _float, end: _float, steps: _int, dtype: Any = None, device: Any = None) -> Tensor:
    _hint(device)
    step = (end - start) / (steps - 1) if steps > 1 else 0.0
    t = empty(steps, dtype=dtype or DEFAULT_FLOAT)
    t._s.recorder.record(Instr("arange", (_vp(float(start)), _vp(float(step))), (_tp(t),)))
    return t


def rand(*shape: Any, dtype: Any = None, requires_grad: _bool = False, device: Any = None) -> Tensor:
    _hint(device)
    t = empty(*shape, dtype=dtype, requires_grad=requires_grad)
    return t.uniform_(0.0, 1.0)


def randn(*shape: Any, dtype: Any = None, requires_grad: _bool = False, device: Any = None) -> Tensor:
    _hint(device)
    t = empty(*shape, dtype=dtype, requires_grad=requires_grad)
    return t.normal_(0.0, 1.0)


def randint(low: _int, high: _int | None = None, size: Any = (), dtype: Any = None, device: Any = None) -> Tensor:
    _hint(device)
    if high is None:
        low, high = 0, low
    elif isinstance(high, (tuple, list)) and size == ():
        low, high, size = 0, low, high  # torch's randint(high, size)
    u = rand(*_shape_args((size,) if isinstance(size, _int) else tuple(size)), dtype="float64")
    # floor(low + u * (high - low)) for u in [0, 1): truncation toward zero equals floor only for non-negatives
    shifted = u * (high - low)
    return shifted.type_as_dtype(dtype_name(dtype) if dtype else DEFAULT_INT) + low


def zeros_like(t: Tensor, dtype: Any = None, device: Any = None) -> Tensor:
    _hint(device)
    return zeros(t.shape, dtype=dtype or t.dtype)


def ones_like(t: Tensor, dtype: Any = None, device: Any = None) -> Tensor:
    _hint(device)
    return ones(t.shape, dtype=dtype or t.dtype)


def full_like(t: Tensor, fill_value: Any, dtype: Any = None, device: Any = None) -> Tensor:
    _hint(device)
    return full(t.shape, fill_value, dtype=dtype or t.dtype)


def empty_like(t: Tensor, dtype: Any = None, device: Any = None) -> Tensor:
    _hint(device)
    return empty(t.shape, dtype=dtype or t.dtype)


def rand_like(t: Tensor, dtype: Any = None, device: Any = None) -> Tensor:
    _hint(device)
    return rand(t.shape, dtype=dtype or t.dtype)


def randn_like(t: Tensor, dtype: Any = None, device: Any = None) -> Tensor:
    _hint(device)
    return randn(t.shape, dtype=dtype or t.dtype)


def tensor(data: Any, dtype: Any = None, requires_grad: _bool = False, device: Any = None) -> Tensor:
    """A tensor from a numpy array, a Python list or a scalar: its bytes are sent to the daemon."""
    _hint(device)
    if isinstance(data, Tensor):
        return data._copy()  # a copy, as torch.tensor(t): not a view
    if dtype is not None:
        arr = np.asarray(data, dtype=to_numpy(dtype_name(dtype)))
    else:
        arr = np.asarray(data)
        if arr.dtype == np.float64 and not isinstance(data, (np.ndarray, np.generic)):
            arr = arr.astype(np.float32)  # Python floats become float32, as in torch
        elif arr.dtype.kind in "iu" and not isinstance(data, (np.ndarray, np.generic)):
            arr = arr.astype(np.int64)
    dt = precision_of(arr.dtype)
    s = session()
    # a collected tensor's name of this shape and dtype where there is one: a loop's batches then take the same
    # names every step, and so do the programs that read them (the daemon's caches see repeats). Not while a call
    # is captured (dx.compile refuses the put)
    if s.recorder.capture is None:
        name, pooled = s.recorder.pooled_name(arr.shape, dt)
    else:
        name, pooled = s.names.new_name(), False
    t = Tensor(name, arr.shape, dt, s, requires_grad)
    try:
        s.recorder.put(t.name, arr)
    except BaseException:
        if pooled:
            t._k = None  # the pooled tensor is still there: deleted when this handle goes
        else:
            s.names.never_made(t.name)  # no tensor of that name came to exist: Python must not delete it
        raise
    return t


def from_numpy(array: np.ndarray) -> Tensor:
    return tensor(array)


def as_tensor(data: Any, dtype: Any = None, device: Any = None) -> Tensor:
    _hint(device)
    return data if isinstance(data, Tensor) and dtype is None else tensor(data, dtype=dtype)


# ---------------------------------------------------------------- functions with several tensors


#: dtypes whose 2-D matmul takes matmul's fast path (the op takes every NUMERIC dtype; these are the usual)
_MATMUL_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16"})


def matmul(a: Tensor, b: Tensor) -> Tensor:
    if _amp.dtype is not None:
        a, b = _amp_lower(a, b)
    sa, sb = a.shape, b.shape
    if len(sa) == 2 and len(sb) == 2 and sa[1] == sb[0] and a.dtype is b.dtype and a.dtype in _MATMUL_DTYPES:
        # two matrices of one dtype (a Linear layer's): what the general path below works out, without its steps
        return a._op("matmul", (a._p or _tp(a), b._p or _tp(b)), (sa[0], sb[1]), a.dtype, [a, b])
    dt = promote(a.dtype, b.dtype)
    a, b = a.type_as_dtype(dt), b.type_as_dtype(dt)
    squeeze_a, squeeze_b = a.ndim == 1, b.ndim == 1
    if squeeze_a:
        a = a.reshape(1, -1)
    if squeeze_b:
        b = b.reshape(-1, 1)
    meta = a._infer("matmul", [TensorMeta(a.shape, a.dtype), TensorMeta(b.shape, b.dtype)], [a.name, b.name])
    if a._s.explicit_broadcast and a.shape[:-2] != b.shape[:-2]:
        a = a.expand(*meta.shape[:-2], *a.shape[-2:])
        b = b.expand(*meta.shape[:-2], *b.shape[-2:])
    out = a._op("matmul", (_tp(a), _tp(b)), meta.shape, dt, [a, b])
    if squeeze_a:
        out = out.squeeze(-2)
    if squeeze_b:
        out = out.squeeze(-1)
    return out


# torch's arithmetic functions (dx.add, ...; Tensor.add and the others call them), a number on either side
# (dx.pow(2.0, t), dx.add(1.0, t)): the operators do the rest
def add(a: Any, b: Any, *, alpha: Any = 1) -> Tensor:
    return a + (b * alpha if alpha != 1 else b)  # type: ignore[no-any-return]


def sub(a: Any, b: Any, *, alpha: Any = 1) -> Tensor:
    return a - (b * alpha if alpha != 1 else b)  # type: ignore[no-any-return]


def rsub(a: Any, b: Any, *, alpha: Any = 1) -> Tensor:
    return b - (a * alpha if alpha != 1 else a)  # type: ignore[no-any-return]


def mul(a: Any, b: Any) -> Tensor:
    return a * b  # type: ignore[no-any-return]


def div(a: Any, b: Any, *, rounding_mode: str | None = None) -> Tensor:
    """a / b; rounding_mode='trunc' rounds toward zero as torch's (integers stay integers); 'floor' is refused."""
    if rounding_mode is None:
        return a / b  # type: ignore[no-any-return]
    if rounding_mode == "trunc":
        x, y, reverse = (a, b, False) if isinstance(a, Tensor) else (b, a, True)
        if not isinstance(x, Tensor):
            raise DeepxError("div: one of a and b must be a Tensor")
        q = x._binary("div", y, "divscalar", "rdivscalar", reverse)  # the integer kernels truncate toward zero
        return q.trunc() if q.dtype in _FLOAT_RANK else q
    if rounding_mode == "floor":
        return _divmod("floordiv", a, b)
    raise DeepxError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")


def floor_divide(a: Any, b: Any) -> Tensor:
    """a // b rounded toward minus infinity, as torch's (no gradient, as torch has none)."""
    return _divmod("floordiv", a, b)


def remainder(a: Any, b: Any) -> Tensor:
    """a % b with the sign of b, as Python's and torch's."""
    return _divmod("remainder", a, b)


def fmod(a: Any, b: Any) -> Tensor:
    """The remainder of a / b truncated toward zero (the sign of a), as C's fmod and torch's."""
    return _divmod("fmod", a, b)


_DIVMOD_NAMES = {"floordiv": "// (floor division)", "remainder": "% (remainder)", "fmod": "fmod"}


def _divmod(op: str, a: Any, b: Any) -> Tensor:
    """floordiv, remainder or fmod of a and b as torch's: where either is floating, the catalogue's op of that name
    (exact, from C's fmod), of a scalar where one is a number; integers (and bools) through _int_divmod."""
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        raise DeepxError(f"{_DIVMOD_NAMES[op]}: one of its operands must be a Tensor")
    if any(x.dtype in _FLOAT_RANK if isinstance(x, Tensor) else isinstance(x, (_float, np.floating)) for x in (a, b)):
        t, o, reverse = (a, b, False) if isinstance(a, Tensor) else (b, a, True)
        return t._binary(op, o, f"{op}scalar", f"r{op}scalar", reverse, floating=True)
    q, r = _int_divmod(_DIVMOD_NAMES[op], a, b, floor=op != "fmod")
    return q if op == "floordiv" else r


def _int_divmod(what: str, a: Any, b: Any, floor: _bool = True) -> tuple[Tensor, Tensor]:
    """Integer a // b and a % b as torch's (rounded toward minus infinity, the remainder taking b's sign), exact:
    the kernels' division truncates, and where the remainder is non-zero and its sign differs from b's, the
    quotient steps down and the remainder gains b. floor=False: C's truncated pair (fmod)."""
    q = div(a, b, rounding_mode="trunc")
    r = a - q * b
    if not floor:
        return q, r
    if isinstance(b, Tensor):
        off = (r != 0).logical_and((r < 0).logical_xor(b < 0))
        return q - off.type_as_dtype(q.dtype), r + where(off, b, 0).type_as_dtype(r.dtype)
    off = r < 0 if b > 0 else r > 0  # b a Python int (zero: the division above refused it)
    return q - off.type_as_dtype(q.dtype), r + off.type_as_dtype(r.dtype) * b


def pow(a: Any, b: Any) -> Tensor:
    return a ** b  # type: ignore[no-any-return]


def _sqrt_zero_grad(t: Tensor) -> Tensor:
    """sqrt(t) whose gradient where t == 0 is 0, as torch's std() and norm() give: sqrt's own is infinite there,
    and times t's zero gradient (a constant row) it was NaN. The same values; NaN stays NaN (NaN != 0)."""
    if not t.requires_grad:
        return t.sqrt()
    nonzero = t != 0
    return where(nonzero, where(nonzero, t, 1.0).sqrt(), 0.0)


def where(cond: Tensor, x: Any, y: Any) -> Tensor:
    """where(c, x, y) arrives as switch([y x], c), as deepxIR writes it."""
    if isinstance(x, Tensor) and isinstance(y, Tensor):
        dt = result_type(x, y)
    elif isinstance(x, Tensor) or isinstance(y, Tensor):
        dt = scalar_dtype(x.dtype, y) if isinstance(x, Tensor) else scalar_dtype(y.dtype, x)
    else:
        if isinstance(x, _float) or isinstance(y, _float):
            dt = DEFAULT_FLOAT
        else:
            dt = "bool" if isinstance(x, _bool) and isinstance(y, _bool) else DEFAULT_INT
    if not isinstance(x, Tensor):
        x = full((), x, dtype=dt)
    if not isinstance(y, Tensor):
        y = full((), y, dtype=dt)
    ref = x
    x, y = x.type_as_dtype(dt), y.type_as_dtype(dt)
    if cond.dtype not in ("bool", "int32"):
        cond = cond.bool()
    shape = broadcast("where", cond.shape, x.shape, y.shape, names=[cond.name, x.name, y.name])
    if ref._s.explicit_broadcast:
        cond, x, y = cond.expand(shape), x.expand(shape), y.expand(shape)
    return ref._op("switch", (Param("listtensor", (dt,), (y.name, x.name)), _tp(cond)), shape, dt, [x, y, cond])


def cat(tensors: Sequence[Tensor], dim: _int = 0) -> Tensor:
    if not tensors:
        raise DeepxError("cat: the list of tensors is empty")
    dt = tensors[0].dtype
    for t in tensors[1:]:
        dt = promote(dt, t.dtype)
    ts = [t.type_as_dtype(dt) for t in tensors]
    first = ts[0]
    meta = first._infer("concat", [[TensorMeta(t.shape, t.dtype) for t in ts], int(dim)], [[t.name for t in ts], None])
    return first._op("concat", (Param("listtensor", (dt,), tuple(t.name for t in ts)), _vp(int(dim))), meta.shape,
                     dt, ts)


concat = cat


def stack(tensors: Sequence[Tensor], dim: _int = 0) -> Tensor:
    if not tensors:
        raise DeepxError("stack: the list of tensors is empty")
    d = norm_dim("stack", dim, tensors[0].ndim + 1)
    return cat([t.unsqueeze(d) for t in tensors], d)


def maximum(a: Tensor, b: Tensor) -> Tensor:
    return a.maximum(b)


def minimum(a: Tensor, b: Tensor) -> Tensor:
    return a.minimum(b)
