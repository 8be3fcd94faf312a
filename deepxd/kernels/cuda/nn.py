"""softmax, logsoftmax, layernorm, rmsnorm, crossentropy and mse on the device, with block-level reductions: one
thread block per row, computed in float32 (float64 for float64 tensors) like the CPU kernels. The activations
(relu, sigmoid, tanh, gelu, silu, erf) are elementwise kernels (elementwise.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from deepx_sdk.errors import DeepxError
from deepx_sdk.ir.dtypes import FLOATS
from deepxd.kernels.cuda import elementwise as ew
from deepxd.kernels.cuda._src import HEADER, ctype

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

_SRC = r"""
typedef typename Acc<T>::type A;
__device__ __forceinline__ A finite_or_zero(A m) { return isfinite(m) ? m : (A)0; }

// one block per row of `size` elements at stride `inner` (rows: outer x inner); with `cache`, a contiguous row is
// read once into shared memory (dynamic, size elements of A) and the later passes read it there
extern __shared__ __align__(16) unsigned char smem_raw[];
template <bool LOG> __device__ void softmax_rows(T* out, const T* a, ll rows, ll size, ll inner, int cache) {
    A* buf = (A*)smem_raw;
    for (ll row = blockIdx.x; row < rows; row += gridDim.x) {
        ll base = (row / inner) * size * inner + (row % inner);
        A m = -INFINITY;
        if (cache) {
            for (ll r = threadIdx.x; r < size; r += blockDim.x) { A v = ld(a[base + r]); buf[r] = v; m = mx(m, v); }
        } else {
            for (ll r = threadIdx.x; r < size; r += blockDim.x) m = mx(m, ld(a[base + r * inner]));
        }
        m = finite_or_zero(block_max(m));
        A s = 0;
        if (cache) {
            for (ll r = threadIdx.x; r < size; r += blockDim.x) s += exp(buf[r] - m);
        } else {
            for (ll r = threadIdx.x; r < size; r += blockDim.x) s += exp(ld(a[base + r * inner]) - m);
        }
        s = block_sum(s);
        A ls = log(s);
        for (ll r = threadIdx.x; r < size; r += blockDim.x) {
            A x = cache ? buf[r] : ld(a[base + r * inner]);
            out[base + r * inner] = LOG ? st<T>((x - m) - ls) : st<T>(exp(x - m) / s);
        }
    }
}
extern "C" __global__ void softmax(T* out, const T* a, ll rows, ll size, ll inner, int cache) {
    softmax_rows<false>(out, a, rows, size, inner, cache);
}
extern "C" __global__ void logsoftmax(T* out, const T* a, ll rows, ll size, ll inner, int cache) {
    softmax_rows<true>(out, a, rows, size, inner, cache);
}

extern "C" __global__ void layernorm(T* out, const T* a, const T* w, const T* b, ll rows, ll n, double eps,
                                     int cache) {
    A* buf = (A*)smem_raw;
    for (ll row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* x = a + row * n;
        A s = 0;
        if (cache) {
            for (ll i = threadIdx.x; i < n; i += blockDim.x) { A v = ld(x[i]); buf[i] = v; s += v; }
        } else {
            for (ll i = threadIdx.x; i < n; i += blockDim.x) s += ld(x[i]);
        }
        A mean = block_sum(s) / (A)n;
        A v = 0;
        for (ll i = threadIdx.x; i < n; i += blockDim.x) { A d = (cache ? buf[i] : ld(x[i])) - mean; v += d * d; }
        A var = block_sum(v) / (A)n;
        A rstd = (A)1 / sqrt(var + (A)eps);
        for (ll i = threadIdx.x; i < n; i += blockDim.x)
            out[row * n + i] = st<T>(((cache ? buf[i] : ld(x[i])) - mean) * rstd * ld(w[i]) + ld(b[i]));
    }
}
extern "C" __global__ void rmsnorm(T* out, const T* a, const T* w, ll rows, ll n, double eps, int cache) {
    A* buf = (A*)smem_raw;
    for (ll row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* x = a + row * n;
        A s = 0;
        for (ll i = threadIdx.x; i < n; i += blockDim.x) {
            A v = ld(x[i]);
            if (cache) buf[i] = v;
            s += v * v;
        }
        A ms = block_sum(s) / (A)n;
        A r = (A)1 / sqrt(ms + (A)eps);
        for (ll i = threadIdx.x; i < n; i += blockDim.x)
            out[row * n + i] = st<T>((cache ? buf[i] : ld(x[i])) * r * ld(w[i]));
    }
}

// crossentropy, per row: -log_softmax(logits)[label] (0 where ignored) into loss[row]; keep[row] = 1 if counted
template <class TL> __device__ void ce_rows(A* loss, A* keep, const T* logits, const TL* labels, ll n, ll c,
                                            ll ignore, int* err) {
    for (ll row = blockIdx.x; row < n; row += gridDim.x) {
        const T* x = logits + row * c;
        ll label = (ll)labels[row];
        bool kept = label != ignore;
        if (kept && (label < 0 || label >= c)) { if (threadIdx.x == 0) atomicExch(err, 1); kept = false; }
        A m = -INFINITY;
        for (ll i = threadIdx.x; i < c; i += blockDim.x) m = mx(m, ld(x[i]));
        m = finite_or_zero(block_max(m));
        A s = 0;
        for (ll i = threadIdx.x; i < c; i += blockDim.x) s += exp(ld(x[i]) - m);
        s = block_sum(s);
        if (threadIdx.x == 0) {
            loss[row] = kept ? -((ld(x[label]) - m) - log(s)) : (A)0;
            keep[row] = kept ? (A)1 : (A)0;
        }
    }
}
extern "C" __global__ void ce_rows_int32(A* loss, A* keep, const T* logits, const int* labels, ll n, ll c, ll ignore,
                                         int* err) { ce_rows(loss, keep, logits, labels, n, c, ignore, err); }
extern "C" __global__ void ce_rows_int64(A* loss, A* keep, const T* logits, const ll* labels, ll n, ll c, ll ignore,
                                         int* err) { ce_rows(loss, keep, logits, labels, n, c, ignore, err); }

// one block: out = sum(loss) / sum(keep) (mean) or sum(loss) (sum)
extern "C" __global__ void ce_total(T* out, const A* loss, const A* keep, ll n, int mean) {
    A s = 0, k = 0;
    for (ll i = threadIdx.x; i < n; i += blockDim.x) { s += loss[i]; k += keep[i]; }
    s = block_sum(s);
    k = block_sum(k);
    if (threadIdx.x == 0) out[0] = mean ? st<T>((double)s / (double)k) : st<T>(s);
}
extern "C" __global__ void store(T* out, const A* v, ll n) { GRID_STRIDE(i, n) out[i] = st<T>(v[i]); }

// mse: squared differences (reduction none), or per-block partial sums then one block's total
extern "C" __global__ void sqdiff(T* out, const T* a, const T* b, ll n) {
    GRID_STRIDE(i, n) { A d = ld(a[i]) - ld(b[i]); out[i] = st<T>(d * d); }
}
extern "C" __global__ void sqdiff_partial(A* partial, const T* a, const T* b, ll n) {
    A s = 0;
    GRID_STRIDE(i, n) { A d = ld(a[i]) - ld(b[i]); s += d * d; }
    s = block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
extern "C" __global__ void partial_total(T* out, const A* partial, int parts, ll count, int mean) {
    A s = 0;
    for (int i = threadIdx.x; i < parts; i += blockDim.x) s += partial[i];
    s = block_sum(s);
    if (threadIdx.x == 0) out[0] = st<T>(mean ? s / (A)count : s);
}
"""

_NN = ("softmax", "logsoftmax", "layernorm", "rmsnorm", "crossentropy", "mse")
SUPPORT = {op: frozenset(FLOATS) for op in _NN}
# the activations live in elementwise.py; the executor finds their kernels there
SUPPORT.update({op: ew.SUPPORT[op] for op in ("relu", "sigmoid", "tanh", "gelu", "silu", "erf") if op in ew.SUPPORT})
relu, sigmoid, tanh, gelu, silu, erf = ew.relu, ew.sigmoid, ew.tanh, ew.gelu, ew.silu, ew.erf


@functools.cache
def source(dtype: str) -> str:
    return HEADER + f"typedef {ctype(dtype)} T;\n" + _SRC


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"nn ({d})") for d in sorted(FLOATS)]


def _fn(ex: CudaExecutor, dtype: str, name: str, fmt: str, op: str) -> Any:
    return ex.function(f"nn:{dtype}", source(dtype), name, fmt, op)


def _acc_size(dtype: str) -> int:
    return 8 if dtype == "float64" else 4


#: a row is kept in shared memory (read from device memory once) when it fits the default 48 KB per block, less the
#: block reductions' own shared words
SMEM_LIMIT = 44 * 1024


def _cache_bytes(dtype: str, n: int) -> int:
    size = n * _acc_size(dtype)
    return size if 0 < size <= SMEM_LIMIT else 0


def _block(n: int) -> int:
    return 1024 if n >= 4096 else 256 if n > 128 else 64


def _softmax(op: str, ex: CudaExecutor, a: DeviceTensor, dim: int, out: DeviceTensor) -> bool:
    if a.ndim == 0:
        from deepxd.kernels.cuda.init import fill_bytes

        fill_bytes(ex, op, out, 1 if op == "softmax" else 0)
        return True
    dim %= a.ndim
    size = a.shape[dim]
    inner = 1
    for d in a.shape[dim + 1:]:
        inner *= d
    rows = a.size // size if size else 0
    if rows == 0 or size == 0:
        return True
    smem = _cache_bytes(a.dname, size) if inner == 1 else 0
    f = _fn(ex, a.dname, op, "PPqqqi", op)
    ex.launch(op, f, (min(rows, 1 << 20), 1, 1), (_block(size), 1, 1), out.ptr, a.ptr, rows, size, inner,
              1 if smem else 0, shared=smem)
    return True


def softmax(ex: CudaExecutor, a: DeviceTensor, dim: int, out: DeviceTensor) -> bool:
    return _softmax("softmax", ex, a, dim, out)


def logsoftmax(ex: CudaExecutor, a: DeviceTensor, dim: int, out: DeviceTensor) -> bool:
    return _softmax("logsoftmax", ex, a, dim, out)


def layernorm(ex: CudaExecutor, a: DeviceTensor, w: DeviceTensor, b: DeviceTensor, eps: Any,
              out: DeviceTensor) -> bool:
    n = w.size
    if n == 0:
        return False
    rows = a.size // n
    if rows:
        smem = _cache_bytes(a.dname, n)
        f = _fn(ex, a.dname, "layernorm", "PPPPqqdi", "layernorm")
        ex.launch("layernorm", f, (min(rows, 1 << 20), 1, 1), (_block(n), 1, 1), out.ptr, a.ptr, w.ptr, b.ptr, rows,
                  n, float(eps), 1 if smem else 0, shared=smem)
    return True


def rmsnorm(ex: CudaExecutor, a: DeviceTensor, w: DeviceTensor, eps: Any, out: DeviceTensor) -> bool:
    n = w.size
    if n == 0:
        return False
    rows = a.size // n
    if rows:
        smem = _cache_bytes(a.dname, n)
        f = _fn(ex, a.dname, "rmsnorm", "PPPqqdi", "rmsnorm")
        ex.launch("rmsnorm", f, (min(rows, 1 << 20), 1, 1), (_block(n), 1, 1), out.ptr, a.ptr, w.ptr, rows, n,
                  float(eps), 1 if smem else 0, shared=smem)
    return True


def crossentropy(ex: CudaExecutor, logits: DeviceTensor, labels: DeviceTensor, ignore_index: int, reduction: str,
                 out: DeviceTensor) -> bool:
    if reduction not in ("mean", "sum", "none"):
        raise DeepxError(f"crossentropy: reduction must be mean, sum or none, got {reduction!r}")
    n, c = logits.shape
    dt = logits.dname
    if not -(2**63) <= ignore_index < 2**63:
        return False
    size = _acc_size(dt)
    loss = ex.alloc(max(n, 1) * size, "crossentropy", "(row losses)")
    keep = ex.alloc(max(n, 1) * size, "crossentropy", "(row counts)")
    if n:
        f = _fn(ex, dt, f"ce_rows_{labels.dname}", "PPPPqqqP", "crossentropy")
        ex.clear_flag()
        ex.launch("crossentropy", f, (min(n, 1 << 20), 1, 1), (_block(c), 1, 1), int(loss), int(keep), logits.ptr,
                  labels.ptr, n, c, ignore_index, ex.flag_ptr)
        ex.raise_flag("crossentropy", f"a label is out of range for {c} classes")
    if reduction == "none":
        if n:
            f = _fn(ex, dt, "store", "PPq", "crossentropy")
            ex.launch("crossentropy", f, ex.grid(n), (256, 1, 1), out.ptr, int(loss), n)
        return True
    f = _fn(ex, dt, "ce_total", "PPPqi", "crossentropy")
    ex.launch("crossentropy", f, (1, 1, 1), (1024, 1, 1), out.ptr, int(loss), int(keep), n,
              1 if reduction == "mean" else 0)
    return True


def mse(ex: CudaExecutor, a: DeviceTensor, b: DeviceTensor, reduction: str, out: DeviceTensor) -> bool:
    if reduction not in ("mean", "sum", "none"):
        raise DeepxError(f"mse: reduction must be mean, sum or none, got {reduction!r}")
    n = a.size
    dt = a.dname
    if reduction == "none":
        if n:
            f = _fn(ex, dt, "sqdiff", "PPPq", "mse")
            ex.launch("mse", f, ex.grid(n), (256, 1, 1), out.ptr, a.ptr, b.ptr, n)
        return True
    parts = max(1, min(ex.sm_count * 4, -(-n // 2048)))
    partial = ex.alloc(parts * _acc_size(dt), "mse", "(partial sums)")
    f = _fn(ex, dt, "sqdiff_partial", "PPPq", "mse")
    ex.launch("mse", f, (parts, 1, 1), (256, 1, 1), int(partial), a.ptr, b.ptr, n)
    fin = _fn(ex, dt, "partial_total", "PPiqi", "mse")
    ex.launch("mse", fin, (1, 1, 1), (1024, 1, 1), out.ptr, int(partial), parts, n, 1 if reduction == "mean" else 0)
    return True
