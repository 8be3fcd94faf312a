"""matmul: the floats through cuBLAS (gemm.py), the integers through a tiled CUDA kernel (wrapping like numpy).

Batch dims broadcast: an operand whose batch is the whole batch walks it with a stride, one with a single matrix is
shared with stride 0, and any other broadcast (batch (3, 1) against (1, 4)) is first expanded on the device.
matmultransposed hands its flags to cuBLAS (op(A) = A^T): the operand is read transposed where it lies.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from deepx_core.cache import memoize
from deepxd.kernels.cuda._src import FLOAT_TYPES, HEADER, INT_TYPES, ctype

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

_INT_GEMM = r"""
#define TILE 16
extern "C" __global__ void imatmul(T* c, const T* a, const T* b, int m, int n, int k, ll sa, ll sb, ll sc) {
    __shared__ ll ta[TILE][TILE + 1];
    __shared__ ll tb[TILE][TILE + 1];
    const T* A = a + blockIdx.z * sa;
    const T* B = b + blockIdx.z * sb;
    int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
    ll acc = 0;
    for (int t = 0; t < k; t += TILE) {
        int ka = t + threadIdx.x, kb = t + threadIdx.y;
        ta[threadIdx.y][threadIdx.x] = (row < m && ka < k) ? (ll)A[(ll)row * k + ka] : 0;
        tb[threadIdx.y][threadIdx.x] = (kb < k && col < n) ? (ll)B[(ll)kb * n + col] : 0;
        __syncthreads();
        #pragma unroll
        for (int j = 0; j < TILE; ++j) acc += ta[threadIdx.y][j] * tb[j][threadIdx.x];
        __syncthreads();
    }
    if (row < m && col < n) c[blockIdx.z * sc + (ll)row * n + col] = (T)acc;
}
"""

SUPPORT = {"matmul": FLOAT_TYPES | INT_TYPES, "matmultransposed": FLOAT_TYPES}


@memoize("kernels.cuda.matmul.source", 64)
def source(dtype: str) -> str:
    return HEADER + f"typedef {ctype(dtype)} T;\n" + _INT_GEMM


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"matmul ({d})") for d in sorted(INT_TYPES)]


def _operand(ex: CudaExecutor, t: DeviceTensor, batch: tuple[int, ...], rows: int, cols: int) -> tuple[int, int]:
    """(pointer, batch stride) of an operand, expanded over `batch` on the device where strides cannot say it."""
    nb = math.prod(batch)
    own = math.prod(t.shape[:-2])
    if own == nb:
        return t.ptr, rows * cols
    if own == 1:
        return t.ptr, 0
    from deepxd.kernels.cuda.shape import expand

    full = expand(ex, "matmul", t, (*batch, rows, cols))
    return full.ptr, rows * cols


def matmul(ex: CudaExecutor, a: DeviceTensor, b: DeviceTensor, out: DeviceTensor) -> bool:
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    batch = tuple(out.shape[:-2])
    nb = math.prod(batch)
    if out.size == 0:
        return True
    if k == 0:
        from deepxd.kernels.cuda.init import fill_bytes

        fill_bytes(ex, "matmul", out, 0)
        return True
    pa, sa = _operand(ex, a, batch, m, k)
    pb, sb = _operand(ex, b, batch, k, n)
    dt = a.dname
    if dt in FLOAT_TYPES:
        ex.blas().gemm(dt, m, n, k, pa, pb, out.ptr, batch=nb, stride_a=sa, stride_b=sb, stride_c=m * n)
        return True
    f = ex.function(f"matmul:{dt}", source(dt), "imatmul", "PPPiiiqqq", "matmul")
    for z0 in range(0, nb, 65535):
        z = min(65535, nb - z0)
        ex.launch("matmul", f, ((n + 15) // 16, (m + 15) // 16, z), (16, 16, 1),
                  out.ptr + z0 * m * n * out.dtype.itemsize, pa + z0 * sa * a.dtype.itemsize,
                  pb + z0 * sb * b.dtype.itemsize, m, n, k, sa, sb, m * n)
    return True


def matmultransposed(ex: CudaExecutor, a: DeviceTensor, b: DeviceTensor, transpose_a: bool, transpose_b: bool,
                     out: DeviceTensor) -> bool:
    m = a.shape[-1] if transpose_a else a.shape[-2]
    k = a.shape[-2] if transpose_a else a.shape[-1]
    n = b.shape[-2] if transpose_b else b.shape[-1]
    batch = tuple(out.shape[:-2])
    if a.dname not in FLOAT_TYPES:
        return False
    if out.size == 0:
        return True
    if k == 0:
        from deepxd.kernels.cuda.init import fill_bytes

        fill_bytes(ex, "matmultransposed", out, 0)
        return True
    pa, sa = _operand(ex, a, batch, a.shape[-2], a.shape[-1])
    pb, sb = _operand(ex, b, batch, b.shape[-2], b.shape[-1])
    ex.blas().gemm(a.dname, m, n, k, pa, pb, out.ptr, trans_a=bool(transpose_a), trans_b=bool(transpose_b),
                   batch=math.prod(batch), stride_a=sa, stride_b=sb, stride_c=m * n)
    return True
