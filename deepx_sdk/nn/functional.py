"""deepx_sdk.nn.functional: torch.nn.functional's names, recorded as deepx instructions (the fused, numerically
stable ops of the catalogue where one exists)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import FLOATS
from deepx_core.ir.instr import Param
from deepx_core.ir.shapes import broadcast, norm_dim
from deepx_sdk.amp import lower, upper
from deepx_sdk.amp import state as _amp
from deepx_sdk.nn.vision import adaptive_avg_pool2d as adaptive_avg_pool2d
from deepx_sdk.nn.vision import avg_pool2d as avg_pool2d
from deepx_sdk.nn.vision import batch_norm as batch_norm
from deepx_sdk.nn.vision import conv1d as conv1d
from deepx_sdk.nn.vision import conv2d as conv2d
from deepx_sdk.nn.vision import conv_transpose2d as conv_transpose2d
from deepx_sdk.nn.vision import dropout2d as dropout2d
from deepx_sdk.nn.vision import group_norm as group_norm
from deepx_sdk.nn.vision import interpolate as interpolate
from deepx_sdk.nn.vision import max_pool2d as max_pool2d
from deepx_sdk.tensor import (
    DEFAULT_FLOAT,
    Tensor,
    _seed,
    _sqrt_zero_grad,
    _tp,
    _vec,
    _vp,
    arange,
    full,
    matmul,
    result_type,
    where,
)

_F = TypeVar("_F", bound=Callable[..., Any])

def _float(x: Tensor) -> Tensor:
    return x if x.dtype in FLOATS else x.type_as_dtype(DEFAULT_FLOAT)


def _float32_in_autocast(fn: _F) -> _F:
    """An op of autocast's float32 list: under autocast its half tensor arguments are cast to float32 first."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _amp.dtype is not None:
            args = tuple(upper(a) if isinstance(a, Tensor) else a for a in args)
            kwargs = {k: upper(v) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


def _write_back(x: Tensor, y: Tensor, inplace: bool) -> Tensor:
    """torch's inplace=True: the result written into x, which is returned."""
    return x.copy_(y) if inplace and y is not x else y


def relu(x: Tensor, inplace: bool = False) -> Tensor:
    return _write_back(x, x.relu(), inplace)  # (relu's gradient reads its result: x may be overwritten)


def sigmoid(x: Tensor) -> Tensor:
    return x.sigmoid()


def tanh(x: Tensor) -> Tensor:
    return x.tanh()


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    if approximate not in ("none", "tanh"):
        raise DeepxError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    x = _float(x)
    return x._op("gelu", (_tp(x), _vp(approximate)), x.shape, x.dtype, [x])


def silu(x: Tensor, inplace: bool = False) -> Tensor:
    # silu's gradient reads its input: written in place inside a graph, it reads a copy of the old value (writing x
    # itself made backward refuse "a value the forward program overwrites", which torch's silu_ does not)
    src = _float(x.clone() if inplace and x.requires_grad and x._s.grad_enabled else x)
    return _write_back(x, src._op("silu", (_tp(src),), src.shape, src.dtype, [src]), inplace)


def _implicit_dim(x: Tensor, dim: int | None, what: str) -> int:
    """torch's dim for softmax without one (deprecated there, with a warning): 0 for 0-, 1- and 3-D inputs, else 1."""
    if dim is not None:
        return dim
    import warnings

    # a warning once per calling line, as torch's (a log line per call flooded a training loop: review)
    warnings.warn(f"{what}: implicit dimension choice is deprecated, as in torch; pass dim", UserWarning, stacklevel=3)
    return 0 if x.ndim in (0, 1, 3) else 1


def softmax(x: Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: Any = None) -> Tensor:
    return (x.to(dtype) if dtype is not None else x).softmax(_implicit_dim(x, dim, "softmax"))


def log_softmax(x: Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: Any = None) -> Tensor:
    return (x.to(dtype) if dtype is not None else x).log_softmax(_implicit_dim(x, dim, "log_softmax"))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    if _amp.dtype is not None:
        x, weight, bias = lower(x, weight, bias)
    y = matmul(x, weight.t() if weight.ndim == 2 else weight)
    if bias is None:
        return y
    if bias.dtype is y.dtype and bias.shape == y.shape[-1:] and not y._s.explicit_broadcast:
        # a bias of the result's last dim and dtype: the `y + bias` below, without working out a broadcast and a
        # promotion that cannot change anything (every Linear, every step)
        return y._op("add", (y._p or _tp(y), bias._p or _tp(bias)), y.shape, y.dtype, [y, bias])
    return y + bias


def embedding(index: Tensor, weight: Tensor, padding_idx: int | None = None, max_norm: float | None = None,
              norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    """weight[index], with torch's gradient: none for the row padding_idx, and with scale_grad_by_freq each row's
    divided by how often the batch names it."""
    if index.dtype not in ("int64", "int32"):
        raise DeepxError(f"embedding: indices must be int64 or int32, got {index.dtype}")
    if max_norm is not None:
        raise DeepxError("embedding: max_norm is not supported yet; leave it None")
    if sparse:
        raise DeepxError("embedding: sparse gradients are not supported; leave sparse=False")
    rows = weight.shape[0]
    if padding_idx is not None:
        if not -rows <= padding_idx < rows:
            raise DeepxError(f"embedding: padding_idx {padding_idx} must be within num_embeddings ({rows})")
        padding_idx %= rows
    shape = (*index.shape, *weight.shape[1:])
    out = weight._op("indexselect", (_tp(weight), _tp(index), Param.var(0)), shape, weight.dtype, [weight, index])
    if not out.requires_grad:
        return out
    if scale_grad_by_freq:  # the same values; the gradient of each position divided by its row's count
        flat = index.reshape(-1)
        ones = full(flat.shape, 1, dtype=weight.dtype)
        zero = full((rows,), 0, dtype=weight.dtype)
        counts = zero._op("indexadd", (_tp(zero), _tp(flat), _tp(ones), Param.var(0)), (rows,), weight.dtype,
                          [zero, flat, ones])
        freq = counts._op("indexselect", (_tp(counts), _tp(index), Param.var(0)), index.shape, weight.dtype,
                          [counts, index])
        held = out.detach()
        out = held + (out - held) * (1.0 / freq).unsqueeze(-1)
    if padding_idx is not None:  # the same values; no gradient reaches the padding row
        out = where((index == padding_idx).unsqueeze(-1), out.detach(), out)
    return out


def dropout(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    if not 0.0 <= p <= 1.0:
        raise DeepxError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:  # torch's: everything dropped
        return _write_back(x, x * 0.0, inplace)
    from deepx_core.ir.instr import Instr

    out = x.clone()
    instr = Instr("dropout", (_vp(float(p)), _vp(_seed(x._s))), (_tp(out),))
    x._s.recorder.record(instr)
    if out.requires_grad:
        x._s.tape.append((instr, out, (out,)))
    return _write_back(x, out, inplace)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """softmax(query @ key^T * scale + mask) @ value over the last two dims, as torch's: a bool attn_mask keeps the
    True positions, a float one is added; is_causal masks the upper triangle (aligned top-left).

    Without dropout, one `attention` op (a fused kernel: no (L, S) scores in memory) when query, key and value share a
    float dtype and their leading dims (or, with enable_gqa, key and value have fewer heads); with attn_mask one
    `maskedattention` op where the mask is bool or the query's dtype, broadcasts to the scores and takes no
    gradient; else the composite of matmuls, masks and softmax."""
    grouped = enable_gqa and query.ndim >= 3 and key.ndim >= 3 and key.shape[-3] != query.shape[-3]
    if grouped:
        hq, hk = query.shape[-3], key.shape[-3]
        if hq % hk or value.shape[-3] != hk:
            raise DeepxError(f"scaled_dot_product_attention: enable_gqa needs the query's {hq} heads to be a multiple "
                             f"of the key's and value's ({hk} and {value.shape[-3]})")
    if _amp.dtype is not None:
        query, key, value = lower(query, key, value)
    if dropout_p == 0.0 and _fits_attention(query, key, value, grouped) and _fits_mask(query, key, attn_mask,
                                                                                       is_causal):
        return _attention(query, key, value, scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]),
                          is_causal, attn_mask)
    if grouped:
        from deepx_sdk.composite import repeat_interleave

        key, value = repeat_interleave(key, hq // hk, -3), repeat_interleave(value, hq // hk, -3)
    if query.ndim < 2 or key.ndim < 2 or value.ndim < 2:
        raise DeepxError(f"scaled_dot_product_attention: query, key and value need (..., L, E) shapes, got "
                         f"{query.shape}, {key.shape}, {value.shape}")
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise DeepxError(f"scaled_dot_product_attention: query {query.shape}, key {key.shape} and value "
                         f"{value.shape} do not match (query and key share E, key and value share S)")
    if is_causal and attn_mask is not None:
        raise DeepxError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both")
    q = _float(query)
    scores = matmul(q, key.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    length, source = q.shape[-2], key.shape[-2]
    dead = None
    if is_causal:  # top-left aligned: every row keeps its first key
        attn_mask = arange(source) <= arange(length).unsqueeze(-1)
    elif attn_mask is not None:
        if attn_mask.dtype != "bool" and attn_mask.dtype != scores.dtype:
            raise DeepxError(f"scaled_dot_product_attention: attn_mask must be bool or {scores.dtype} as the query, "
                             f"got {attn_mask.dtype}")
    if attn_mask is not None:
        if attn_mask.dtype == "bool":
            attn_mask = where(attn_mask, full((), 0.0, dtype=scores.dtype), full((), -math.inf, dtype=scores.dtype))
        scores = scores + attn_mask
        if not is_causal:
            # torch's safe softmax: a row whose every key is masked attends to nothing (zeros), instead of NaN that
            # would reach every gradient of the model (a padded batch)
            dead = scores.amax(-1, keepdim=True) == -math.inf
            scores = where(dead, 0.0, scores)
    attn = scores.softmax(-1)
    if dead is not None:
        attn = where(dead, 0.0, attn)
    if dropout_p > 0.0:
        attn = dropout(attn, dropout_p)
    return matmul(attn, value)


def _fits_attention(q: Tensor, k: Tensor, v: Tensor, grouped: bool) -> bool:
    """Whether the attention op takes these operands as they are: one float dtype, ranks of at least 2, and the same
    leading dims (or grouped heads) and sizes where they meet; the composite handles (or refuses) the rest."""
    if q.dtype not in FLOATS or k.dtype != q.dtype or v.dtype != q.dtype or not 2 <= q.ndim == k.ndim == v.ndim:
        return False
    if q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        return False
    return q.shape[:-2] == k.shape[:-2] or (grouped and q.shape[:-3] == k.shape[:-3])


def _fits_mask(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> bool:
    """Whether maskedattention takes this mask (none: attention): bool or q's dtype, broadcasting to the scores as
    they are, without a gradient, and not beside is_causal (the composite refuses that)."""
    if mask is None:
        return True
    scores = (*q.shape[:-1], k.shape[-2])
    return (not causal and mask.dtype in ("bool", q.dtype) and not mask.requires_grad and mask.ndim <= len(scores)
            and all(a in (1, b) for a, b in zip(mask.shape[::-1], scores[::-1])))


def _attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, mask: Tensor | None = None) -> Tensor:
    """One attention op (maskedattention with a mask): the result, and each row's logsumexp, which the gradient
    reads (held by the result's graph node, with the inputs, for as long as the graph lives)."""
    from deepx_core.ir.instr import Instr
    from deepx_core.ir.ops import lse_dtype

    out = q._new((*q.shape[:-1], v.shape[-1]), q.dtype)
    lse = q._new(q.shape[:-1], lse_dtype(q.dtype))
    if mask is None:
        instr = Instr("attention", (_tp(q), _tp(k), _tp(v), _vp(float(scale)), _vp(bool(causal))),
                      (_tp(out), _tp(lse)))
        held: tuple[Tensor, ...] = (q, k, v, lse)
    else:
        instr = Instr("maskedattention", (_tp(q), _tp(k), _tp(v), _tp(mask), _vp(float(scale))), (_tp(out), _tp(lse)))
        held = (q, k, v, mask, lse)
    s = q._s
    s.recorder.record(instr)
    if s.grad_enabled and (q.requires_grad or k.requires_grad or v.requires_grad):
        out.requires_grad = True
        s.tape.append((instr, out, held))
    return out


def _reduction(reduction: str) -> str:
    if reduction not in ("mean", "sum", "none"):
        raise DeepxError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return reduction


def _torch_loss_args(what: str, weight: Any, size_average: Any, reduce: Any, reduction: str) -> str:
    """torch's loss signature (input, target, weight, size_average, ignore_index, reduce, reduction, ...): class
    weights refused, the legacy flags turned into a reduction as torch does."""
    if weight is not None:
        raise DeepxError(f"{what}: class weights are not supported yet; leave weight None")
    from deepx_sdk.nn.loss import _legacy_reduction

    return _legacy_reduction(size_average, reduce, reduction)


@_float32_in_autocast
def cross_entropy(logits: Tensor, target: Tensor, weight: Any = None, size_average: Any = None,
                  ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    reduction = _torch_loss_args("cross_entropy", weight, size_average, reduce, reduction)
    if label_smoothing:
        raise DeepxError("cross_entropy: label_smoothing is not supported yet")
    if logits.ndim != 2:
        raise DeepxError(f"cross_entropy: logits must be (batch, classes), got {logits.shape}")
    if target.dtype not in ("int64", "int32"):
        raise DeepxError(f"cross_entropy: targets must be class indices (int64), got {target.dtype}")
    logits = _float(logits)
    red = _reduction(reduction)
    shape = () if red != "none" else (logits.shape[0],)
    if target.shape != logits.shape[:1]:
        raise DeepxError(f"cross_entropy: target of shape {target.shape} does not match logits {logits.shape}")
    return logits._op("crossentropy", (_tp(logits), _tp(target), _vp(int(ignore_index)), _vp(red)), shape,
                      logits.dtype, [logits, target])


@_float32_in_autocast
def nll_loss(logp: Tensor, target: Tensor, weight: Any = None, size_average: Any = None, ignore_index: int = -100,
             reduce: Any = None, reduction: str = "mean") -> Tensor:
    """-input[i, target[i]], averaged over the targets that are not ignore_index (for any input: log-probabilities
    or not)."""
    reduction = _torch_loss_args("nll_loss", weight, size_average, reduce, reduction)
    if logp.ndim != 2:
        raise DeepxError(f"nll_loss: input must be (batch, classes), got {logp.shape}")
    if target.dtype not in ("int64", "int32"):
        raise DeepxError(f"nll_loss: targets must be class indices (int64), got {target.dtype}")
    if target.shape != logp.shape[:1]:
        raise DeepxError(f"nll_loss: target of shape {target.shape} does not match input {logp.shape}")
    logp = _float(logp)
    red = _reduction(reduction)
    c = logp.shape[1]
    valid = target != ignore_index
    if c:
        # input[i, target[i]] as one gather along the classes, the target checked first against [0, classes) (an
        # ignored row reads column 0), so that a target out of range fails the step, as torch's does
        column = _checked_index("nll_loss", where(valid, target, 0), c)
        picked = logp.gather(1, column.unsqueeze(1)).squeeze(1)
    else:  # no class at all: every target is out of range (unchecked here) or ignored (torch's NaN below)
        picked = logp.sum(1)
    loss = where(valid, -picked, 0.0)
    if red == "none":
        return loss
    if red == "sum":
        return loss.sum()
    # every target ignored: NaN, as torch, without a 0 / 0 in the graph (its gradient was NaN everywhere; torch's is 0)
    count = valid.sum()
    none = count == 0
    nan = where(none, full((), math.nan, dtype=loss.dtype), full((), 0.0, dtype=loss.dtype))  # the loss's dtype
    return loss.sum() / where(none, 1, count).type_as_dtype(loss.dtype) + nan


@_float32_in_autocast
def mse_loss(x: Tensor, y: Tensor, size_average: Any = None, reduce: Any = None, reduction: str = "mean",
             weight: Any = None) -> Tensor:
    red = _reduction(_torch_loss_args("mse_loss", weight, size_average, reduce, reduction))
    # torch's promotion: an integer target takes the input's dtype, two float dtypes the wider
    x = _float(x)
    if y.dtype not in FLOATS:
        y = y.type_as_dtype(x.dtype)
    elif y.dtype != x.dtype:
        dt = result_type(x, y)
        x, y = x.type_as_dtype(dt), y.type_as_dtype(dt)
    if x.shape != y.shape:  # both ways, as torch (which warns that the shapes differ)
        both = broadcast("mse_loss", x.shape, y.shape, names=[x.name, y.name])
        x, y = x.expand(both), y.expand(both)
    shape = () if red != "none" else x.shape
    return x._op("mse", (_tp(x), _tp(y), _vp(red)), shape, x.dtype, [x, y])


@_float32_in_autocast
def layer_norm(x: Tensor, normalized_shape: Any, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    x = _float(x)
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if x.shape[len(x.shape) - len(ns):] != ns:
        raise DeepxError(f"layer_norm: normalized_shape {list(ns)} does not match the last dims of {x.shape}")
    w = weight if weight is not None else full(ns, 1.0, dtype=x.dtype)
    b = bias if bias is not None else full(ns, 0.0, dtype=x.dtype)
    return x._op("layernorm", (_tp(x), _tp(w), _tp(b), _vp(float(eps))), x.shape, x.dtype, [x, w, b])


@_float32_in_autocast
def rms_norm(x: Tensor, normalized_shape: Any, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    x = _float(x)
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if x.shape[len(x.shape) - len(ns):] != ns:
        raise DeepxError(f"rms_norm: normalized_shape {list(ns)} does not match the last dims of {x.shape}")
    w = weight if weight is not None else full(ns, 1.0, dtype=x.dtype)
    # eps=None: the epsilon of the dtype torch computes in (its opmath type: float32 for float16 and bfloat16)
    e = eps if eps is not None else float(__import__("numpy").finfo(x.dtype if x.dtype == "float64"
                                                                     else "float32").eps)
    return x._op("rmsnorm", (_tp(x), _tp(w), _vp(float(e))), x.shape, x.dtype, [x, w])


def pad(x: Tensor, pad: Any, mode: str = "constant", value: float = 0.0) -> Tensor:
    """torch's order: pad = (last_before, last_after, second_last_before, ...)."""
    if mode != "constant":
        raise DeepxError(f"pad: only mode='constant' is supported, got {mode!r}")
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise DeepxError(f"pad: {list(pad)} must hold (before, after) pairs for at most {x.ndim} dims")
    pads = [0] * (2 * x.ndim)
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        pads[2 * d], pads[2 * d + 1] = int(pad[2 * i]), int(pad[2 * i + 1])
    shape = tuple(s + pads[2 * i] + pads[2 * i + 1] for i, s in enumerate(x.shape))
    return x._op("pad", (_tp(x), _vec(pads), _vp(value)), shape, x.dtype, [x])


@_float32_in_autocast
def normalize(x: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Tensor:
    if p != 2.0:
        raise DeepxError("normalize: only p=2 is supported")
    norm_dim("normalize", dim, x.ndim)
    n = _sqrt_zero_grad((x * x).sum(dim, keepdim=True)).clamp(min=eps)  # an all-zero row: torch's 1/eps, not NaN
    return x / n


def one_hot(index: Tensor, num_classes: int = -1) -> Tensor:
    """torch's: num_classes=-1 takes the largest index + 1 (reading it from the daemon, as torch reads it); an index
    outside [0, num_classes) fails, as torch's."""
    from deepx_sdk.tensor import arange

    if index.dtype not in ("int64", "int32", "int16", "int8"):
        raise DeepxError(f"one_hot: indices must be integers (int64), got {index.dtype}")
    if num_classes == -1:
        if not index.numel():
            raise DeepxError("one_hot: cannot infer the number of classes from an empty tensor; pass num_classes")
        num_classes = int(index.max().item()) + 1
    return (_checked_index("one_hot", index, num_classes).unsqueeze(-1) == arange(num_classes)).long()


def _checked_index(what: str, index: Tensor, size: int) -> Tensor:
    """`index` itself (int64 or int32; a narrower integer as int64), read through a gather from arange(size): the
    daemon refuses an index outside [0, size) there (`indexselect: index 10 out of range for axis 0 of size 10`),
    failing the program at `what`'s line."""
    from deepx_sdk.tensor import arange

    if size <= 0:
        raise DeepxError(f"{what}: the number of classes must be positive, got {size}")
    if index.dtype not in ("int64", "int32"):
        index = index.type_as_dtype("int64")
    table = arange(size, dtype=index.dtype)
    flat = index.reshape(-1)
    return table._op("indexselect", (_tp(table), _tp(flat), Param.var(0)), flat.shape, table.dtype,
                     [table, flat]).reshape(index.shape)


__all__ = ["cross_entropy", "dropout", "embedding", "gelu", "layer_norm", "linear", "log_softmax", "mse_loss",
           "nll_loss", "normalize", "one_hot", "pad", "relu", "rms_norm", "scaled_dot_product_attention", "sigmoid",
           "silu", "softmax", "tanh", "where"]


# ---------------------------------------------------------------- losses written with elementwise ops


def _pointwise_args(what: str, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """The input and target in one float dtype and one shape (torch requires the same shape for these losses)."""
    x = _float(x)
    y = y.type_as_dtype(x.dtype) if y.dtype != x.dtype else y
    if x.shape != y.shape:
        raise DeepxError(f"{what}: the target's shape {list(y.shape)} differs from the input's {list(x.shape)} "
                         f"('{y.name}' and '{x.name}')")
    return x, y


def _reduced(loss: Tensor, reduction: str, what: str) -> Tensor:
    red = _reduction(reduction) if reduction != "batchmean" or what != "kl_div" else reduction
    if red == "mean":
        return loss.mean()
    if red == "sum":
        return loss.sum()
    if red == "batchmean":
        return loss.sum() / (loss.shape[0] if loss.ndim else 1)
    return loss


@_float32_in_autocast
def binary_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: Any = None,
                         reduce: Any = None, reduction: str = "mean") -> Tensor:
    """-(t log x + (1 - t) log(1 - x)), each log clamped at -100 as torch's; `weight` multiplies elementwise."""
    from deepx_sdk.nn.loss import _legacy_reduction

    x, t = _pointwise_args("binary_cross_entropy", input, target)
    loss = -(t * x.log().clamp(min=-100.0) + (1 - t) * (1 - x).log().clamp(min=-100.0))
    if weight is not None:
        loss = loss * weight
    return _reduced(loss, _legacy_reduction(size_average, reduce, reduction), "binary_cross_entropy")


@_float32_in_autocast
def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Tensor | None = None,
                                     size_average: Any = None, reduce: Any = None, reduction: str = "mean",
                                     pos_weight: Tensor | None = None) -> Tensor:
    """BCE of sigmoid(input), computed stably as torch does: (1 - t) x + (1 + (pos_weight - 1) t) (log(1 +
    exp(-|x|)) + max(-x, 0))."""
    from deepx_sdk.nn.loss import _legacy_reduction

    x, t = _pointwise_args("binary_cross_entropy_with_logits", input, target)
    soft = (1 + (-x.abs()).exp()).log() + (-x).relu()
    loss = (1 - t) * x + (soft if pos_weight is None else (1 + (pos_weight - 1) * t) * soft)
    if weight is not None:
        loss = loss * weight
    return _reduced(loss, _legacy_reduction(size_average, reduce, reduction), "binary_cross_entropy_with_logits")


@_float32_in_autocast
def l1_loss(input: Tensor, target: Tensor, size_average: Any = None, reduce: Any = None,
            reduction: str = "mean") -> Tensor:
    from deepx_sdk.nn.loss import _legacy_reduction

    x, t = _pointwise_args("l1_loss", input, target)
    return _reduced((x - t).abs(), _legacy_reduction(size_average, reduce, reduction), "l1_loss")


@_float32_in_autocast
def smooth_l1_loss(input: Tensor, target: Tensor, size_average: Any = None, reduce: Any = None,
                   reduction: str = "mean", beta: float = 1.0) -> Tensor:
    """0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta (beta 0: the L1 loss)."""
    from deepx_sdk.nn.loss import _legacy_reduction

    if beta < 0:
        raise DeepxError(f"smooth_l1_loss: beta must be >= 0, got {beta}")
    x, t = _pointwise_args("smooth_l1_loss", input, target)
    d = (x - t).abs()
    loss = d if beta == 0 else where(d < beta, d * d * (0.5 / beta), d - 0.5 * beta)
    return _reduced(loss, _legacy_reduction(size_average, reduce, reduction), "smooth_l1_loss")


@_float32_in_autocast
def huber_loss(input: Tensor, target: Tensor, reduction: str = "mean", delta: float = 1.0) -> Tensor:
    """0.5 d^2 where |d| < delta, else delta (|d| - 0.5 delta)."""
    if delta <= 0:
        raise DeepxError(f"huber_loss: delta must be > 0, got {delta}")
    x, t = _pointwise_args("huber_loss", input, target)
    d = (x - t).abs()
    return _reduced(where(d < delta, d * d * 0.5, (d - 0.5 * delta) * delta), reduction, "huber_loss")


@_float32_in_autocast
def kl_div(input: Tensor, target: Tensor, size_average: Any = None, reduce: Any = None, reduction: str = "mean",
           log_target: bool = False) -> Tensor:
    """target (log target - input) pointwise, 0 where target is 0 (input holds log-probabilities; log_target: so
    does target); reduction 'batchmean' divides the sum by the batch size (the KL divergence), 'mean' by every
    element, as torch."""
    from deepx_sdk.nn.loss import _legacy_reduction

    x, t = _pointwise_args("kl_div", input, target)
    if log_target:
        loss = t.exp() * (t - x)
    else:
        safe = where(t > 0, t, 1.0)  # torch's xlogy(t, t): 0 log 0 is 0, with a finite gradient
        loss = t * safe.log() - t * x
    return _reduced(loss, _legacy_reduction(size_average, reduce, reduction), "kl_div")


@_float32_in_autocast
def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """log(1 + exp(beta x)) / beta, and x itself where beta x > threshold, as torch."""
    x = _float(x)
    bx = x * beta if beta != 1 else x
    soft = (1 + bx.clamp(max=threshold).exp()).log()
    return where(bx > threshold, x, soft if beta == 1 else soft / beta)
