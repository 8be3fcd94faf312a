"""Shape ops on the device: transpose, concat, broadcastTo, slice, sliceassign, pad, repeat (one strided-copy
kernel per item size: they only move bytes, so every storable dtype, float8 included, is handled), indexselect,
gather, scatter and indexcopy (byte movers too; repeated indices: one write wins, which one unsaid), indexadd and
scatteradd (atomic adds; float16/bfloat16 and int8/int16 accumulate in a float32/int32 buffer and round once, as the
CPU does) and switch (select among up to 8 tensors by case). Index and case values are checked on the device before
anything is written; a bad one raises DeepxError.
"""

from __future__ import annotations

import builtins
import math
from typing import TYPE_CHECKING, Any

from deepx_core.cache import memoize
from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import NUMERIC, STORABLE
from deepxd.kernels.cuda._src import BYTES_TYPE, HEADER, MAXD, ctype, dims, dims_format, divisors
from deepxd.kernels.cuda.elementwise import _strides, collapse

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

_ALONG_OFFSET = r"""
// gather and scatter along a dim: element i of the index (row-major in its `shape`) stands at its own position in
// every dim but `dim`, where its value says; `st` are the element strides of A (gather's source, scatter's output)
__device__ __forceinline__ ll along_offset(ll i, ll at, int nd, int dim, const Dims& shape, const Dims& st) {
    ll r = i, off = 0;
    #pragma unroll
    for (int d = MAXD - 1; d >= 0; --d) {
        if (d < nd) {
            ll q = r / shape.v[d], k = r - q * shape.v[d];
            r = q;
            off += (d == dim ? at : k) * st.v[d];
        }
    }
    return off;
}
"""

_MOVE = _ALONG_OFFSET + r"""
template <class T> __device__ void scopy(T* dst, const T* src, ll n, int nd, const Dims& shape, const Dims& div,
                                         const Dims& sd, const Dims& ss) {
    GRID_STRIDE(i, n) {
        ll od = 0, os = 0;
        FOR_COORDS(i, nd, shape, div, od += k * sd.v[d]; os += k * ss.v[d];)
        dst[od] = src[os];
    }
}
template <class TI> __device__ void check(const TI* idx, ll n, ll hi, int* err) {
    GRID_STRIDE(i, n) { ll v = (ll)idx[i]; if (v < 0 || v >= hi) atomicExch(err, 1); }
}
template <class T, class TI> __device__ void gather(T* out, const T* a, const TI* idx, ll n, ll nidx, ll dim,
                                                    ll inner) {
    GRID_STRIDE(i, n) {
        ll in_ = i % inner, r = i / inner, j = r % nidx, o = r / nidx;
        out[i] = a[(o * dim + (ll)idx[j]) * inner + in_];
    }
}
template <class T, class TI> __device__ void index_copy(T* out, const T* src, const TI* idx, ll n, ll nidx, ll dim,
                                                        ll inner) {
    GRID_STRIDE(i, n) {
        ll in_ = i % inner, r = i / inner, j = r % nidx, o = r / nidx;
        out[(o * dim + (ll)idx[j]) * inner + in_] = src[i];
    }
}
template <class T, class TI> __device__ void gather_dim(T* out, const T* a, const TI* idx, ll n, int nd, int dim,
                                                        const Dims& shape, const Dims& st) {
    GRID_STRIDE(i, n) out[i] = a[along_offset(i, (ll)idx[i], nd, dim, shape, st)];
}
template <class T, class TI> __device__ void scatter_dim(T* out, const T* src, const TI* idx, ll n, int nd, int dim,
                                                         const Dims& shape, const Dims& st) {
    GRID_STRIDE(i, n) out[along_offset(i, (ll)idx[i], nd, dim, shape, st)] = src[i];
}
struct Ptrs { const void* p[8]; };
struct Dims8 { Dims d[8]; };
template <class T, class TC> __device__ void select(T* out, const TC* cases, ll n, int nd, Dims shape, Dims sc,
                                                    Ptrs ps, Dims8 st) {
    GRID_STRIDE(i, n) {
        ll r = i, oc = 0;
        ll k_[MAXD];
        #pragma unroll
        for (int d = MAXD - 1; d >= 0; --d) {
            k_[d] = 0;
            if (d < nd) {
                ll q = r / shape.v[d], k = r - q * shape.v[d];
                r = q; k_[d] = k; oc += k * sc.v[d];
            }
        }
        int t = (int)(ll)cases[oc];
        ll off = 0;
        #pragma unroll
        for (int d = 0; d < MAXD; ++d) off += k_[d] * st.d[t].v[d];
        out[i] = ((const T*)ps.p[t])[off];
    }
}
"""

_INDEX_TYPES = {"int32": "int", "int64": "ll"}
_CASE_TYPES = {"int64": "ll", "int32": "int", "int16": "short", "int8": "signed char", "bool": "bool"}


def _move_source() -> str:
    parts = [HEADER, _MOVE]
    for size, t in BYTES_TYPE.items():
        parts.append(f'extern "C" __global__ void scopy{size}({t}* dst, const {t}* src, ll n, int nd, Dims shape, '
                     f"Dims div, Dims sd, Dims ss) {{ scopy(dst, src, n, nd, shape, div, sd, ss); }}\n")
        for iname, it in _INDEX_TYPES.items():
            parts.append(f'extern "C" __global__ void gather{size}_{iname}({t}* out, const {t}* a, const {it}* idx, '
                         f"ll n, ll nidx, ll dim, ll inner) {{ gather(out, a, idx, n, nidx, dim, inner); }}\n")
            parts.append(f'extern "C" __global__ void indexcopy{size}_{iname}({t}* out, const {t}* src, '
                         f"const {it}* idx, ll n, ll nidx, ll dim, ll inner) "
                         "{ index_copy(out, src, idx, n, nidx, dim, inner); }\n")
            for kind in ("gather", "scatter"):
                parts.append(f'extern "C" __global__ void {kind}dim{size}_{iname}({t}* out, const {t}* a, '
                             f"const {it}* idx, ll n, int nd, int dim, Dims shape, Dims st) "
                             f"{{ {kind}_dim(out, a, idx, n, nd, dim, shape, st); }}\n")
        for cname, ct in _CASE_TYPES.items():
            parts.append(f'extern "C" __global__ void select{size}_{cname}({t}* out, const {ct}* cases, ll n, int nd, '
                         "Dims shape, Dims sc, Ptrs ps, Dims8 st) "
                         "{ select(out, cases, n, nd, shape, sc, ps, st); }\n")
    parts.append('extern "C" __global__ void scopy16(uint4* dst, const uint4* src, ll n, int nd, Dims shape, Dims div, '
                 "Dims sd, Dims ss) { scopy(dst, src, n, nd, shape, div, sd, ss); }\n")  # _widened's 16-byte items
    for cname, ct in _CASE_TYPES.items():
        parts.append(f'extern "C" __global__ void check_{cname}(const {ct}* idx, ll n, ll hi, int* err) '
                     "{ check(idx, n, hi, err); }\n")
    return "".join(parts)


MOVE_SOURCE = _move_source()

_ADD = r"""
template <class TI> __device__ void index_add(TT* acc, const T* src, const TI* idx, ll n, ll nidx, ll dim, ll inner) {
    GRID_STRIDE(i, n) {
        ll in_ = i % inner, r = i / inner, j = r % nidx, o = r / nidx;
        TT v = (TT)ld(src[i]);
        ATOMIC_ADD(&acc[(o * dim + (ll)idx[j]) * inner + in_], v);
    }
}
extern "C" __global__ void indexadd_int32(TT* acc, const T* src, const int* idx, ll n, ll nidx, ll dim, ll inner) {
    index_add(acc, src, idx, n, nidx, dim, inner);
}
extern "C" __global__ void indexadd_int64(TT* acc, const T* src, const ll* idx, ll n, ll nidx, ll dim, ll inner) {
    index_add(acc, src, idx, n, nidx, dim, inner);
}
// scatteradd: element i of src (index-shaped) into acc where along_offset says
template <class TI> __device__ void scatter_add(TT* acc, const T* src, const TI* idx, ll n, int nd, int dim,
                                                const Dims& shape, const Dims& st) {
    GRID_STRIDE(i, n) {
        TT v = (TT)ld(src[i]);
        ATOMIC_ADD(&acc[along_offset(i, (ll)idx[i], nd, dim, shape, st)], v);
    }
}
extern "C" __global__ void scatteradd_int32(TT* acc, const T* src, const int* idx, ll n, int nd, int dim, Dims shape,
                                            Dims st) {
    scatter_add(acc, src, idx, n, nd, dim, shape, st);
}
extern "C" __global__ void scatteradd_int64(TT* acc, const T* src, const ll* idx, ll n, int nd, int dim, Dims shape,
                                            Dims st) {
    scatter_add(acc, src, idx, n, nd, dim, shape, st);
}
"""

#: dtype -> (accumulator dtype, accumulator C type, atomic add)
_ACC = {
    "float64": ("float64", "double", "atomicAdd(p, v)"),
    "float32": ("float32", "float", "atomicAdd(p, v)"),
    "float16": ("float32", "float", "atomicAdd(p, v)"),
    "bfloat16": ("float32", "float", "atomicAdd(p, v)"),
    "int64": ("int64", "ll", "atomicAdd((ull*)(p), (ull)(v))"),
    "int32": ("int32", "int", "atomicAdd(p, v)"),
    "int16": ("int32", "int", "atomicAdd(p, v)"),
    "int8": ("int32", "int", "atomicAdd(p, v)"),
}


@memoize("kernels.cuda.shape.add_source", 64)
def add_source(dtype: str) -> str:
    _, tt, atomic = _ACC[dtype]
    return (HEADER + f"typedef {ctype(dtype)} T;\ntypedef {tt} TT;\n#define ATOMIC_ADD(p, v) {atomic}\n" + _ALONG_OFFSET
            + _ADD)


def sources() -> list[tuple[str, str]]:
    return [(MOVE_SOURCE, "shape"), *((add_source(d), f"indexadd ({d})") for d in sorted(_ACC))]


_ANY = frozenset(STORABLE)
SUPPORT = {"transpose": _ANY, "concat": _ANY, "broadcastTo": _ANY, "slice": _ANY, "sliceassign": _ANY, "pad": _ANY,
           "repeat": _ANY, "indexselect": _ANY, "indexadd": frozenset(NUMERIC), "indexcopy": _ANY, "switch": _ANY,
           "gather": _ANY, "scatter": _ANY, "scatteradd": frozenset(NUMERIC)}

_COPY_FMT = "PPqi" + dims_format(4)


def contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    st = [0] * len(shape)
    step = 1
    for i in range(len(shape) - 1, -1, -1):
        st[i] = step
        step *= shape[i]
    return st


def strided_copy(ex: CudaExecutor, op: str, dst: int, src: int, itemsize: int, shape: tuple[int, ...],
                 dst_strides: list[int], src_strides: list[int]) -> bool:
    """dst[offsets by dst_strides] = src[offsets by src_strides] over `shape` (element strides, from the pointers).
    False when the copy needs more dims than the indexer has."""
    n = math.prod(shape)
    if n == 0:
        return True
    sh, (sd, ss) = collapse(shape, dst_strides, src_strides)
    if len(sh) > MAXD:
        return False
    if len(sh) <= 1 and (not sh or (sd[0] == 1 and ss[0] == 1)):
        ex.cuda.memcpy_dtod_async(dst, src, n * itemsize, ex.stream)
        return True
    itemsize, sh, sd, ss = _widened(itemsize, sh, sd, ss, dst, src)
    n = math.prod(sh)
    f = ex.function("shape", MOVE_SOURCE, f"scopy{itemsize}", _COPY_FMT, op)
    ex.launch(op, f, ex.grid(n), (256, 1, 1), dst, src, n, len(sh), *dims(sh), *divisors(sh, n), *dims(sd),
              *dims(ss))
    return True


def _widened(itemsize: int, shape: list[int], sd: list[int], ss: list[int], dst: int, src: int
             ) -> tuple[int, list[int], list[int], list[int]]:
    """The same copy in the widest items (up to 16 bytes) that the innermost dim, contiguous on both sides, splits
    into, where both pointers and every stride allow: a head split (..., 64 floats) moves 16 floats a thread."""
    if sd[-1] != 1 or ss[-1] != 1:
        return itemsize, shape, sd, ss
    for wide in (16, 8):
        if wide <= itemsize:
            break
        f = wide // itemsize
        if (shape[-1] % f or dst % wide or src % wide
                or any(s % f for s in sd[:-1]) or any(s % f for s in ss[:-1])):
            continue
        return wide, [*shape[:-1], shape[-1] // f], [*(s // f for s in sd[:-1]), 1], [*(s // f for s in ss[:-1]), 1]
    return itemsize, shape, sd, ss


def expand(ex: CudaExecutor, op: str, t: DeviceTensor, shape: tuple[int, ...]) -> DeviceTensor:
    """`t` broadcast to `shape` in a fresh tensor."""
    out = ex.empty(shape, t.dtype, op, "(broadcast operand)")
    if not strided_copy(ex, op, out.ptr, t.ptr, t.dtype.itemsize, shape, contiguous_strides(shape),
                        _strides(t.shape, shape)):
        raise DeepxError(f"{op}: broadcasting {list(t.shape)} to {list(shape)} needs more than {MAXD} dims")
    return out


def transpose(ex: CudaExecutor, a: DeviceTensor, perm: Any, out: DeviceTensor) -> bool:
    perm = [p % a.ndim for p in perm] if a.ndim else []
    sa = contiguous_strides(a.shape)
    return strided_copy(ex, "transpose", out.ptr, a.ptr, a.dtype.itemsize, out.shape, contiguous_strides(out.shape),
                        [sa[p] for p in perm])


def broadcastTo(ex: CudaExecutor, a: DeviceTensor, shape: Any, out: DeviceTensor) -> bool:
    return strided_copy(ex, "broadcastTo", out.ptr, a.ptr, a.dtype.itemsize, out.shape,
                        contiguous_strides(out.shape), _strides(a.shape, out.shape))


def concat(ex: CudaExecutor, tensors: list[DeviceTensor], dim: int, out: DeviceTensor) -> bool:
    dim %= out.ndim
    so = contiguous_strides(out.shape)
    size = out.dtype.itemsize
    at = 0
    plans = []
    for t in tensors:
        plans.append((out.ptr + at * so[dim] * size, t))
        at += t.shape[dim]
    if len({t.ptr for t in tensors} & {out.ptr}):
        return False  # an input is the output's buffer
    for ptr, t in plans:
        if not strided_copy(ex, "concat", ptr, t.ptr, size, t.shape, so, contiguous_strides(t.shape)):
            return False
    return True


def _slice_view(shape: tuple[int, ...], starts: Any, ends: Any, steps: Any) -> tuple[int, list[int], tuple[int, ...]]:
    """(base element offset, element strides, shape) of a[starts:ends:steps] in a contiguous tensor of `shape`."""
    st = contiguous_strides(shape)
    base = 0
    strides = []
    out = []
    for d, (b, e, s) in enumerate(zip(starts, ends, steps)):
        r = range(*builtins.slice(int(b), int(e), int(s)).indices(shape[d]))
        out.append(len(r))
        if len(r):
            base += r.start * st[d]
        strides.append(st[d] * r.step)
    return base, strides, tuple(out)


def slice(ex: CudaExecutor, a: DeviceTensor, starts: Any, ends: Any, steps: Any, out: DeviceTensor) -> bool:
    base, strides, shape = _slice_view(a.shape, starts, ends, steps)
    size = a.dtype.itemsize
    return strided_copy(ex, "slice", out.ptr, a.ptr + base * size, size, shape, contiguous_strides(shape), strides)


def sliceassign(ex: CudaExecutor, a: DeviceTensor, starts: Any, ends: Any, steps: Any, v: DeviceTensor,
                out: DeviceTensor) -> bool:
    base, strides, shape = _slice_view(a.shape, starts, ends, steps)
    size = a.dtype.itemsize
    if v.ptr == out.ptr:
        copy = ex.empty(v.shape, v.dtype, "sliceassign", "(value copy)")
        ex.copy(copy, v)
        v = copy
    if out.ptr != a.ptr:
        ex.copy(out, a)
    return strided_copy(ex, "sliceassign", out.ptr + base * size, v.ptr, size, shape, strides,
                        _strides(v.shape, shape))


def pad(ex: CudaExecutor, a: DeviceTensor, pads: Any, value: Any, out: DeviceTensor) -> bool:
    from deepxd.kernels.cuda.init import fill_bytes

    fill_bytes(ex, "pad", out, value)
    so = contiguous_strides(out.shape)
    size = a.dtype.itemsize
    base = sum(pads[2 * i] * so[i] for i in range(a.ndim))
    return strided_copy(ex, "pad", out.ptr + base * size, a.ptr, size, a.shape, so, contiguous_strides(a.shape))


def repeat(ex: CudaExecutor, a: DeviceTensor, reps: Any, out: DeviceTensor) -> bool:
    shape = (1,) * (len(reps) - a.ndim) + a.shape
    sa = contiguous_strides(shape)
    index_shape: list[int] = []
    src: list[int] = []
    for r, d, s in zip(reps, shape, sa):
        index_shape += [int(r), d]
        src += [0, s]
    return strided_copy(ex, "repeat", out.ptr, a.ptr, a.dtype.itemsize, tuple(index_shape),
                        contiguous_strides(tuple(index_shape)), src)


def check_range(ex: CudaExecutor, op: str, idx: DeviceTensor, hi: int, what: str) -> None:
    """Raise DeepxError when a value of `idx` is outside [0, hi)."""
    if idx.size == 0:
        return
    f = ex.function("shape", MOVE_SOURCE, f"check_{idx.dname}", "PqqP", op)
    ex.clear_flag()
    ex.launch(op, f, ex.grid(idx.size), (256, 1, 1), idx.ptr, idx.size, hi, ex.flag_ptr)
    ex.raise_flag(op, what)


def _split(a: DeviceTensor, axis: int) -> tuple[int, int, int]:
    return math.prod(a.shape[:axis]), a.shape[axis], math.prod(a.shape[axis + 1:])


def indexselect(ex: CudaExecutor, a: DeviceTensor, index: DeviceTensor, axis: int, out: DeviceTensor) -> bool:
    axis %= a.ndim
    _outer, dim, inner = _split(a, axis)
    check_range(ex, "indexselect", index, dim, f"an index is out of range for axis {axis} of size {dim}")
    n = out.size
    if n == 0:
        return True
    size = a.dtype.itemsize
    f = ex.function("shape", MOVE_SOURCE, f"gather{size}_{index.dname}", "PPPqqqq", "indexselect")
    ex.launch("indexselect", f, ex.grid(n), (256, 1, 1), out.ptr, a.ptr, index.ptr, n, index.size, dim, inner)
    return True


def _index_into(ex: CudaExecutor, op: str, a: DeviceTensor, index: DeviceTensor, src: DeviceTensor, axis: int,
                out: DeviceTensor) -> tuple[int, int, DeviceTensor]:
    """indexadd's and indexcopy's start: (size of the axis, elements after it, the source), the index checked against
    the axis and a source that is the output's memory copied first (the output is written before it is read)."""
    axis %= a.ndim
    _outer, dim, inner = _split(a, axis)
    check_range(ex, op, index, dim, f"an index is out of range for axis {axis} of size {dim}")
    if src.ptr == out.ptr:
        copy = ex.empty(src.shape, src.dtype, op, "(source copy)")
        ex.copy(copy, src)
        src = copy
    return dim, inner, src


def indexadd(ex: CudaExecutor, a: DeviceTensor, index: DeviceTensor, src: DeviceTensor, axis: int,
             out: DeviceTensor) -> bool:
    from deepxd.kernels.cuda.elementwise import todtype

    dim, inner, src = _index_into(ex, "indexadd", a, index, src, axis, out)
    acc_dtype = _ACC[a.dname][0]
    if acc_dtype == a.dname:
        if out.ptr != a.ptr:
            ex.copy(out, a)
        acc = out
    else:
        acc = ex.empty(a.shape, acc_dtype, "indexadd", "(accumulator)")
        todtype(ex, a, acc)
    n = src.size
    if n:
        f = ex.function(f"indexadd:{a.dname}", add_source(a.dname), f"indexadd_{index.dname}", "PPPqqqq", "indexadd")
        ex.launch("indexadd", f, ex.grid(n), (256, 1, 1), acc.ptr, src.ptr, index.ptr, n, index.size, dim, inner)
    if acc is not out:
        todtype(ex, acc, out)
    return True


def indexcopy(ex: CudaExecutor, a: DeviceTensor, index: DeviceTensor, src: DeviceTensor, axis: int,
              out: DeviceTensor) -> bool:
    dim, inner, src = _index_into(ex, "indexcopy", a, index, src, axis, out)
    if out.ptr != a.ptr:
        ex.copy(out, a)
    n = src.size
    if n:
        size = a.dtype.itemsize
        f = ex.function("shape", MOVE_SOURCE, f"indexcopy{size}_{index.dname}", "PPPqqqq", "indexcopy")
        ex.launch("indexcopy", f, ex.grid(n), (256, 1, 1), out.ptr, src.ptr, index.ptr, n, index.size, dim, inner)
    return True


_ALONG_FMT = "PPPqii" + dims_format(2)


def _along(ex: CudaExecutor, op: str, a: DeviceTensor, index: DeviceTensor, dim: int) -> tuple[int, int] | None:
    """(rank, dim) for a gather or scatter along dim of A by `index`, its values checked against dim's size; None
    where A has more dims than the indexer."""
    if a.ndim > MAXD:
        return None
    dim = dim % a.ndim if a.ndim else 0
    size = a.shape[dim] if a.ndim else 1
    check_range(ex, op, index, size, f"an index is out of range for dim {dim} of size {size}")
    return a.ndim, dim


def gather(ex: CudaExecutor, a: DeviceTensor, index: DeviceTensor, dim: int, out: DeviceTensor) -> bool:
    plan = _along(ex, "gather", a, index, dim)
    if plan is None:
        return False
    n = out.size
    if n:
        size = a.dtype.itemsize
        f = ex.function("shape", MOVE_SOURCE, f"gatherdim{size}_{index.dname}", _ALONG_FMT, "gather")
        ex.launch("gather", f, ex.grid(n), (256, 1, 1), out.ptr, a.ptr, index.ptr, n, *plan, *dims(index.shape),
                  *dims(contiguous_strides(a.shape)))
    return True


def scatter(ex: CudaExecutor, a: DeviceTensor, index: DeviceTensor, src: DeviceTensor, dim: int,
            out: DeviceTensor) -> bool:
    plan = _along(ex, "scatter", a, index, dim)
    if plan is None:
        return False
    ex.copy(out, a)  # a fresh output (scatter is not alias-safe): src and index are never out
    n = src.size
    if n:
        size = a.dtype.itemsize
        f = ex.function("shape", MOVE_SOURCE, f"scatterdim{size}_{index.dname}", _ALONG_FMT, "scatter")
        ex.launch("scatter", f, ex.grid(n), (256, 1, 1), out.ptr, src.ptr, index.ptr, n, *plan, *dims(index.shape),
                  *dims(contiguous_strides(a.shape)))
    return True


def scatteradd(ex: CudaExecutor, a: DeviceTensor, index: DeviceTensor, src: DeviceTensor, dim: int,
               out: DeviceTensor) -> bool:
    from deepxd.kernels.cuda.elementwise import todtype

    plan = _along(ex, "scatteradd", a, index, dim)
    if plan is None:
        return False
    acc_dtype = _ACC[a.dname][0]
    if acc_dtype == a.dname:
        ex.copy(out, a)
        acc = out
    else:
        acc = ex.empty(a.shape, acc_dtype, "scatteradd", "(accumulator)")
        todtype(ex, a, acc)
    n = src.size
    if n:
        f = ex.function(f"indexadd:{a.dname}", add_source(a.dname), f"scatteradd_{index.dname}", _ALONG_FMT,
                        "scatteradd")
        ex.launch("scatteradd", f, ex.grid(n), (256, 1, 1), acc.ptr, src.ptr, index.ptr, n, *plan,
                  *dims(index.shape), *dims(contiguous_strides(a.shape)))
    if acc is not out:
        todtype(ex, acc, out)
    return True


def switch(ex: CudaExecutor, tensors: list[DeviceTensor], cases: DeviceTensor, out: DeviceTensor) -> bool:
    k = len(tensors)
    if k > 8:
        return False
    check_range(ex, "switch", cases, k, f"a case is out of range for a list of {k} tensors")
    n = out.size
    if n == 0:
        return True
    shape = out.shape
    sts = [_strides(t.shape, shape) for t in tensors]
    sh, merged = collapse(shape, _strides(cases.shape, shape), *sts)
    if len(sh) > MAXD:
        return False
    sc, rest = merged[0], merged[1:]
    ptrs = [t.ptr for t in tensors] + [0] * (8 - k)
    st8: list[int] = []
    for i in range(8):
        st8 += dims(rest[i]) if i < k else [0] * MAXD
    size = out.dtype.itemsize
    f = ex.function("shape", MOVE_SOURCE, f"select{size}_{cases.dname}", "PPqi" + dims_format(2) + "8P" +
                    dims_format(8), "switch")
    ex.launch("switch", f, ex.grid(n), (256, 1, 1), out.ptr, cases.ptr, n, len(sh), *dims(sh), *dims(sc), *ptrs,
              *st8)
    return True
