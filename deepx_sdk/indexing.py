"""Tensor indexing as torch does it, recorded as slice / reshape / indexselect / sliceassign instructions.

Supported: ints, slices with positive steps, None, Ellipsis, one integer tensor (gather along its dim), and a
boolean mask (its True positions are read back from the daemon, since they decide the result's shape).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, Param

if TYPE_CHECKING:
    from deepx_sdk.tensor import Tensor


def _expand(t: Tensor, index: Any) -> list[Any]:
    if not isinstance(index, tuple):
        index = (index,)
    used = sum(1 for i in index if i is not None and i is not Ellipsis)
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise DeepxError("an index can only have one ellipsis (...)")
    out: list[Any] = []
    for i in index:
        if i is Ellipsis:
            out.extend([slice(None)] * (t.ndim - used))
        else:
            out.append(i)
    if used > t.ndim:
        raise DeepxError(f"too many indices for a tensor of rank {t.ndim}: {len(index)} given")
    out.extend([slice(None)] * (t.ndim - sum(1 for i in out if i is not None)))
    return out


def _plan(t: Tensor, items: list[Any]) -> tuple[list[int], list[int], list[int], list[int], list[int], Any]:
    """starts/ends/steps per dim, the result's shape, the dims an int removed, and at most one tensor index."""
    from deepx_sdk.tensor import Tensor

    starts, ends, steps, shape = [], [], [], []
    tensor_index: Any = None
    dim = 0
    for item in items:
        if item is None:
            shape.append(-1)  # a new axis, marked; resolved below
            continue
        size = t.shape[dim]
        if isinstance(item, (Tensor, list)) or (hasattr(item, "__array__") and not isinstance(item, (int, slice))):
            if tensor_index is not None:
                raise DeepxError("only one tensor index per indexing expression is supported")
            tensor_index = (len(shape), dim, item)
            starts.append(0)
            ends.append(size)
            steps.append(1)
            shape.append(-2)
        elif isinstance(item, slice):
            if item.step is not None and item.step <= 0:
                raise DeepxError(f"slice step must be positive, got {item.step}")
            b, e, s = item.indices(size)
            starts.append(b)
            ends.append(e)
            steps.append(s)
            shape.append(len(range(b, e, s)))
        elif isinstance(item, int) or hasattr(item, "__index__"):
            i = int(item)
            if not -size <= i < size:
                raise DeepxError(f"index {i} is out of range for dim {dim} of size {size}")
            i %= size
            starts.append(i)
            ends.append(i + 1)
            steps.append(1)
        else:
            raise DeepxError(f"unsupported index {item!r} of type {type(item).__name__}")
        dim += 1
    return starts, ends, steps, shape, [], tensor_index


def getitem(t: Tensor, index: Any) -> Tensor:
    import numpy as np

    from deepx_sdk.tensor import Tensor, _tp, _vec, _viewed, tensor, where

    if _is_mask(index):
        index = tensor(index)
    if isinstance(index, Tensor) and index.dtype == "bool":
        return _mask(t, index)
    items = _expand(t, index)
    starts, ends, steps, shape, _, tix = _plan(t, items)
    out = t
    if (starts, ends, steps) != ([0] * t.ndim, list(t.shape), [1] * t.ndim):
        sliced_shape = tuple(len(range(b, e, s)) for b, e, s in zip(starts, ends, steps))
        out = t._op("slice", (_tp(t), _vec(starts), _vec(ends), _vec(steps)), sliced_shape, t.dtype, [t])
    if tix is not None:
        _, dim, idx = tix
        if not isinstance(idx, Tensor):
            idx = np.asarray(idx)
            if idx.dtype.kind in "iu":
                idx = np.where(idx < 0, idx + t.shape[dim], idx)  # torch counts negative indices from the end
            idx = tensor(idx)
        elif idx.dtype in ("int64", "int32"):
            idx = where(idx < 0, idx + t.shape[dim], idx)
        if idx.dtype == "bool":
            raise DeepxError("a boolean mask must be the only index")
        if idx.dtype not in ("int64", "int32"):
            raise DeepxError(f"index tensors must be int64 or int32, got {idx.dtype}")
        new_shape = (*out.shape[:dim], *idx.shape, *out.shape[dim + 1:])
        out = out._op("indexselect", (_tp(out), _tp(idx), Param.var(dim)), new_shape, out.dtype, [out, idx])
        final: list[int] = []
        for d in shape:
            if d == -2:
                final.extend(idx.shape)
            else:
                final.append(1 if d == -1 else d)
        return out.reshape(tuple(final)) if tuple(final) != out.shape else out
    final_shape = tuple(1 if d == -1 else d for d in shape)
    out = out.reshape(final_shape) if final_shape != out.shape else out
    if out is not t:  # ints, slices, None: a view in torch, a copy here (see Tensor._check_write); marked even
        # where it requires grad: `logits[:, pad].fill_(-1e9)` in a training step would otherwise be lost silently
        _viewed(out, t, always=True)
    return out


def _is_mask(index: Any) -> bool:
    """A numpy bool array, or a list of Python bools: a mask, as torch takes them."""
    import numpy as np

    if isinstance(index, np.ndarray):
        return index.dtype == np.bool_
    return isinstance(index, list) and bool(index) and all(isinstance(i, bool) for i in index)


def _mask(t: Tensor, mask: Tensor) -> Tensor:
    import numpy as np

    from deepx_sdk.tensor import tensor

    k = mask.ndim
    if mask.shape != t.shape[:k]:
        raise DeepxError(f"mask of shape {mask.shape} does not match the leading dims of {t.shape}")
    where = np.flatnonzero(mask.numpy())
    flat = t.reshape(-1, *t.shape[k:]) if k else t.unsqueeze(0)
    return flat[tensor(where.astype(np.int64))]


def _index_text(index: Any) -> str:
    """An index as Python writes it: `:, 1:3, ...`."""

    def one(i: Any) -> str:
        if isinstance(i, slice):
            text = ":".join("" if v is None else str(v) for v in (i.start, i.stop))
            return text + (f":{i.step}" if i.step is not None else "")
        return "..." if i is Ellipsis else "None" if i is None else str(i)

    return ", ".join(one(i) for i in (index if isinstance(index, tuple) else (index,)))


def setitem(t: Tensor, index: Any, value: Any) -> None:
    from deepx_sdk.tensor import Tensor, _tp, _vec, full, tensor, where

    t._check_write("setitem")
    if _is_mask(index):
        index = tensor(index)
    if isinstance(index, Tensor) and index.dtype == "bool":
        if index.shape != t.shape[:index.ndim]:
            raise DeepxError(f"a mask assignment needs a mask of shape {t.shape} or of its leading dims, got "
                             f"{index.shape}")
        if index.ndim < t.ndim:
            index = index.reshape(index.shape + (1,) * (t.ndim - index.ndim))
        t._assign(where(index, value if isinstance(value, Tensor) else full((), value, dtype=t.dtype), t))
        return
    items = _expand(t, index)
    starts, ends, steps, shape, _, tix = _plan(t, items)
    if tix is not None:
        raise DeepxError("assigning through a tensor index is not supported; use index_add_ (adds at the "
                         "indices) or where (a mask)")
    target = tuple(len(range(b, e, s)) for b, e, s in zip(starts, ends, steps))
    if not isinstance(value, Tensor):
        value = full((), value, dtype=t.dtype)
    value = value.type_as_dtype(t.dtype)
    view = tuple(1 if d == -1 else d for d in shape)  # the shape of t[index], which value broadcasts to
    if value.shape != view:
        lead = list(value.shape)
        while lead and lead[0] == 1 and len(lead) > len(view):
            lead.pop(0)
        if len(lead) > len(view) or any(v not in (1, w) for v, w in zip(reversed(lead), reversed(view))):
            raise DeepxError(f"setitem (sliceassign): value '{value.name}' of shape {list(value.shape)} does not fit "
                             f"'{t.name}'[{_index_text(index)}] of shape {list(view)} (of {list(t.shape)}); it must "
                             "broadcast to it")
        value = value.reshape(tuple(lead)) if tuple(lead) != value.shape else value
        value = value.expand(view)
    if value.shape != target:
        value = value.reshape(target)
    instr = Instr("sliceassign", (_tp(t), _vec(starts), _vec(ends), _vec(steps), _tp(value)), (_tp(t),))
    t._s.recorder.record(instr)
    t._tape_in_place(instr, (t, value))
