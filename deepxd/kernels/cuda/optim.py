"""Optimizer updates on the device, in place, with the arithmetic of deepxd/kernels/cpu/optim.py (torch.optim's
single-tensor code paths): hyperparameters are rounded to the compute type as numpy's weak scalars are, and the
16-bit floats compute in float32."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from deepx_core.cache import memoize
from deepx_core.ir.dtypes import FLOATS
from deepxd.kernels.cuda._src import HEADER, ctype

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

_SRC = r"""
typedef typename Acc<T>::type A;
__device__ __forceinline__ void sgd_one(ll i, T* param, const T* grad, T* buf, double lr, double momentum,
                                        double damp1, double wd, int nesterov, int first) {
    A p = ld(param[i]), g = ld(grad[i]);
    if (wd != 0) g = g + (A)wd * p;
    if (momentum != 0) {
        A b;
        if (first) b = g;
        else { b = ld(buf[i]) * (A)momentum; b += (A)damp1 * g; }
        g = nesterov ? g + (A)momentum * b : b;
        buf[i] = st<T>(b);
    }
    param[i] = st<T>(p - (A)lr * g);
}
extern "C" __global__ void sgd(T* param, const T* grad, T* buf, ll n, double lr, double momentum, double damp1,
                               double wd, int nesterov, int first) {
    GRID_STRIDE(i, n) sgd_one(i, param, grad, buf, lr, momentum, damp1, wd, nesterov, first);
}
// the same, its numbers read from device memory (a CUDA graph's: new numbers each step without a new graph)
extern "C" __global__ void sgd_dev(T* param, const T* grad, T* buf, ll n, const double* s) {
    const double lr = s[0], momentum = s[1], damp1 = s[2], wd = s[3];
    const int nesterov = (int)s[4], first = (int)s[5];
    GRID_STRIDE(i, n) sgd_one(i, param, grad, buf, lr, momentum, damp1, wd, nesterov, first);
}
__device__ __forceinline__ void adam_one(ll i, T* param, const T* grad, T* m, T* v, double beta1, double beta2,
                                         double omb1, double omb2, double eps, double wd, double decay,
                                         int decoupled, double step_size, double sqrt_bc2) {
    A p = ld(param[i]), g = ld(grad[i]);
    if (wd != 0) {
        if (decoupled) p = p * (A)decay;
        else g = g + (A)wd * p;
    }
    A m1 = ld(m[i]) * (A)beta1 + (A)omb1 * g;
    A v1 = ld(v[i]) * (A)beta2 + (A)omb2 * (g * g);
    A denom = sqrt(v1) / (A)sqrt_bc2 + (A)eps;
    p = p - (A)step_size * m1 / denom;
    m[i] = st<T>(m1);
    v[i] = st<T>(v1);
    param[i] = st<T>(p);
}
extern "C" __global__ void adam(T* param, const T* grad, T* m, T* v, ll n, double beta1, double beta2, double omb1,
                                double omb2, double eps, double wd, double decay, int decoupled, double step_size,
                                double sqrt_bc2) {
    GRID_STRIDE(i, n) adam_one(i, param, grad, m, v, beta1, beta2, omb1, omb2, eps, wd, decay, decoupled,
                               step_size, sqrt_bc2);
}
extern "C" __global__ void adam_dev(T* param, const T* grad, T* m, T* v, ll n, const double* s) {
    const double beta1 = s[0], beta2 = s[1], omb1 = s[2], omb2 = s[3], eps = s[4], wd = s[5], decay = s[6];
    const int decoupled = (int)s[7];
    const double step_size = s[8], sqrt_bc2 = s[9];
    GRID_STRIDE(i, n) adam_one(i, param, grad, m, v, beta1, beta2, omb1, omb2, eps, wd, decay, decoupled,
                               step_size, sqrt_bc2);
}
"""

SUPPORT = {"sgd": frozenset(FLOATS), "adam": frozenset(FLOATS), "adamw": frozenset(FLOATS)}


@memoize("kernels.cuda.optim.source", 64)
def source(dtype: str) -> str:
    return HEADER + f"typedef {ctype(dtype)} T;\n" + _SRC


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"optim ({d})") for d in sorted(FLOATS)]


def _inplace(ex: CudaExecutor, pairs: list[tuple[DeviceTensor, DeviceTensor]]) -> None:
    for src, dst in pairs:  # outputs that are not their inputs start as copies of them
        if dst.ptr != src.ptr:
            ex.copy(dst, src)


def _update(ex: CudaExecutor, op: str, kernel: str, fmt: str, dev_fmt: str,
            pairs: list[tuple[DeviceTensor, DeviceTensor]], ptrs: tuple[int, ...], numbers: tuple[Any, ...], n: int,
            dname: str) -> None:
    """Launch an update with its numbers as arguments, or, in a CUDA graph capture, its `_dev` kernel reading them
    from the slot the executor gives (`ex.numbers`), which a later step refreshes without launching anything."""
    slot = ex.numbers(numbers) if n else None
    if slot == 0:  # refreshing a captured update's numbers: nothing runs
        return
    _inplace(ex, pairs)
    if not n:
        return
    if slot is None:
        f = ex.function(f"optim:{dname}", source(dname), kernel, fmt, op)
        ex.launch(op, f, ex.grid(n), (256, 1, 1), *ptrs, *numbers)
    else:
        f = ex.function(f"optim:{dname}", source(dname), kernel + "_dev", dev_fmt, op)
        ex.launch(op, f, ex.grid(n), (256, 1, 1), *ptrs, slot)


def sgd(ex: CudaExecutor, param: DeviceTensor, grad: DeviceTensor, buf: DeviceTensor, lr: Any, momentum: Any,
        dampening: Any, weight_decay: Any, nesterov: bool, step: int, param_out: DeviceTensor,
        buf_out: DeviceTensor) -> bool:
    numbers = (float(lr), float(momentum), float(1 - dampening), float(weight_decay), int(bool(nesterov)),
               int(step <= 1))
    _update(ex, "sgd", "sgd", "PPPqddddii", "PPPqP", [(param, param_out), (buf, buf_out)],
            (param_out.ptr, grad.ptr, buf_out.ptr, param.size), numbers, param.size, param.dname)
    return True


def _adam(op: str, decoupled: bool, ex: CudaExecutor, param: DeviceTensor, grad: DeviceTensor, m: DeviceTensor,
          v: DeviceTensor, lr: Any, beta1: Any, beta2: Any, eps: Any, weight_decay: Any, step: int,
          p_out: DeviceTensor, m_out: DeviceTensor, v_out: DeviceTensor) -> bool:
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    numbers = (float(beta1), float(beta2), float(1 - beta1), float(1 - beta2), float(eps), float(weight_decay),
               float(1 - lr * weight_decay), int(decoupled), float(lr / bc1), math.sqrt(bc2))
    _update(ex, op, "adam", "PPPPqdddddddidd", "PPPPqP", [(param, p_out), (m, m_out), (v, v_out)],
            (p_out.ptr, grad.ptr, m_out.ptr, v_out.ptr, param.size), numbers, param.size, param.dname)
    return True


def adam(ex: CudaExecutor, param: DeviceTensor, grad: DeviceTensor, m: DeviceTensor, v: DeviceTensor, lr: Any,
         beta1: Any, beta2: Any, eps: Any, weight_decay: Any, step: int, p_out: DeviceTensor, m_out: DeviceTensor,
         v_out: DeviceTensor) -> bool:
    return _adam("adam", False, ex, param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, p_out, m_out, v_out)


def adamw(ex: CudaExecutor, param: DeviceTensor, grad: DeviceTensor, m: DeviceTensor, v: DeviceTensor, lr: Any,
          beta1: Any, beta2: Any, eps: Any, weight_decay: Any, step: int, p_out: DeviceTensor, m_out: DeviceTensor,
          v_out: DeviceTensor) -> bool:
    return _adam("adamw", True, ex, param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, p_out, m_out,
                 v_out)
