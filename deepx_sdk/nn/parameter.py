"""Parameter: a tensor that a Module owns. Parameters are heap tensors (held by the daemon's heapmem, so they outlive
a program and other processes can attach to them); activations stay stack tensors."""

from __future__ import annotations

from typing import Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy
from deepx_core.ir.instr import Instr, Param
from deepx_sdk.session import Session, session
from deepx_sdk.tensor import DEFAULT_FLOAT, Tensor, dtype_name, format_tensor

Shape = tuple[int, ...]


class Parameter(Tensor):
    """A module's weight: a heap tensor with requires_grad=True, as torch.nn.Parameter.

    `Parameter(tensor)` copies the tensor's values into a new heap tensor; `Parameter(ndarray_or_list)` sends them;
    `Parameter((3, 4))` (a tuple of ints: a shape) is zero-filled; `Parameter()` is empty, as in torch.
    """

    __slots__ = ()

    def __init__(self, data: Any = None, requires_grad: bool = True, *, dtype: Any = None) -> None:
        self._s = None  # type: ignore[assignment]  # until it names a daemon tensor: Tensor.__del__ skips it
        s = data._s if isinstance(data, Tensor) else session()
        want = dtype_name(dtype) if dtype is not None else None
        if data is None or _is_shape(data):
            shape = () if data is None else tuple(int(d) for d in data)
            _init_heap(self, s, (0,) if data is None else shape, want or DEFAULT_FLOAT, requires_grad)
        elif isinstance(data, Tensor):
            src = data.type_as_dtype(want) if want else data
            _init_heap(self, s, src.shape, src.dtype, requires_grad)
            s.recorder.record(Instr("copytensor", (Param.tensor(src.name, src.dtype),),
                                    (Param.tensor(self.name, self.dtype),)))
        else:
            arr = _as_array(data, want)
            Tensor.__init__(self, s.names.new_name(), arr.shape, dtype_name(arr.dtype), s, requires_grad)
            s.recorder.put(self.name, arr, heap=True)

    def _set_data(self, value: Any) -> None:
        load_into(self, value, self.name)

    # the getter: Tensor.data's second handle on the parameter's tensor, which does not require grad (writing it in
    # place writes the parameter, unseen by autograd); the setter loads new values, as torch's param.data = t
    data = property(Tensor.data.fget, _set_data, doc=Tensor.data.__doc__)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        try:
            values = self.numpy()
        except DeepxError as e:
            return f"Parameter containing:\ntensor(<unavailable: {e}>, shape={list(self.shape)}, dtype={self.dtype})"
        return "Parameter containing:\n" + format_tensor(values, self.dtype, self.requires_grad)

    __str__ = __repr__

    def __deepcopy__(self, memo: dict[int, Any]) -> Parameter:
        out = Parameter(self, self.requires_grad)
        self._deepcopied(out, memo)
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise DeepxError("a deepx Parameter cannot be pickled (its values live in the daemon); use dx.save or "
                         "module.state_dict() with .numpy()")


def _is_shape(data: Any) -> bool:
    return isinstance(data, tuple) and all(isinstance(d, int) and not isinstance(d, bool) for d in data) and bool(data)


def _as_array(data: Any, dtype: str | None) -> np.ndarray:
    if dtype is not None:
        return np.array(data, dtype=to_numpy(dtype), order="C")  # not ascontiguousarray: it makes 0-d arrays 1-d
    arr = np.asarray(data)
    if not isinstance(data, np.ndarray):
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)  # Python floats become float32, as in torch
        elif arr.dtype.kind in "iu":
            arr = arr.astype(np.int64)
    return np.array(arr, order="C", copy=None)


def _init_heap(p: Parameter, s: Session, shape: Shape, dtype: str, requires_grad: bool) -> None:
    to_numpy(dtype)
    Tensor.__init__(p, s.names.new_name(), shape, dtype, s, requires_grad)
    s.recorder.made_here(p.name)
    s.recorder.record(Instr("newtensor", (Param.vector(shape),), (Param.tensor(p.name, dtype),), (("kind", "heap"),)))


def heap_parameter(*shape: int, dtype: Any = None, requires_grad: bool = True) -> Parameter:
    """A new zero-filled heap parameter, for a module to initialize in place (`.uniform_`, `.normal_`, `.fill_`)."""
    dt = dtype_name(dtype) if dtype is not None else DEFAULT_FLOAT
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise DeepxError(f"negative dimension in shape {list(dims)}")
    p = Parameter.__new__(Parameter)
    _init_heap(p, session(), dims, dt, requires_grad)
    return p


# --------------------------------------------------------------- loading values into an existing tensor

_KIND_ORDER = {"bool": 0, "int": 1, "float": 2}


def _kind(dtype: np.dtype | str) -> str | None:
    """bool, int or float; None for what a deepx tensor cannot take (complex, strings, objects)."""
    if isinstance(dtype, str):
        return "bool" if dtype == "bool" else "int" if dtype.startswith("int") else "float"
    if dtype.kind == "b":
        return "bool"
    if dtype.kind in "iu":
        return "int"
    if dtype.kind == "f" or dtype.name in ("bfloat16", "float8_e5m2", "float8_e4m3fn"):
        return "float"
    return None


def check_source(target: Tensor, value: Any, key: str) -> str | None:
    """Why `value` cannot be loaded into `target` (None when it can): shapes must match; dtypes convert as torch's
    copy_ does, except for a lossy change of kind (float into an int or bool tensor), which is refused."""
    if isinstance(value, Tensor):
        shape, dtype, kind = value.shape, value.dtype, _kind(value.dtype)
    else:
        try:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        except Exception as e:
            return f"cannot read the value for {key} ({type(value).__name__}) as an array: {e}; pass a dx.Tensor " \
                   "or a numpy array"
        shape, dtype, kind = tuple(arr.shape), str(arr.dtype), _kind(arr.dtype)
    if kind is None:
        return f"dtype mismatch for {key}: the checkpoint holds {dtype}, which a deepx tensor cannot take; " \
               f"convert it to {target.dtype}"
    if tuple(shape) != target.shape:
        return f"size mismatch for {key}: copying a param with shape {list(shape)} from checkpoint, the shape in " \
               f"current model is {list(target.shape)}."
    target_kind = _kind(target.dtype)
    assert target_kind is not None
    if _KIND_ORDER[kind] > _KIND_ORDER[target_kind]:
        return f"dtype mismatch for {key}: copying {dtype} values from checkpoint into a {target.dtype} tensor in " \
               f"the current model would lose values; convert them to {target.dtype} first"
    return None


def load_into(target: Tensor, value: Any, key: str) -> None:
    """Copy `value` (a dx Tensor or an array) into `target` in place, keeping its name (and heap segment)."""
    problem = check_source(target, value, key)
    if problem is not None:
        raise DeepxError(problem)
    if isinstance(value, Tensor):
        if value is not target:
            target.copy_(value)
        return
    arr = np.array(value, dtype=to_numpy(target.dtype), order="C", copy=None)
    if isinstance(target, Parameter):
        # straight into the heap segment, no temporary; the tensor was made where the parameter was
        target._s.recorder.put(target.name, arr, heap=True, made=False)
    else:
        from deepx_sdk.tensor import tensor

        target.copy_(tensor(arr))


__all__ = ["Parameter", "heap_parameter"]
