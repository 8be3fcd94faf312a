"""GEMM through cuBLAS, called with ctypes against the toolkit's libcublas.so.

Row-major C = op(A) @ op(B) is the column-major product C^T = op(B)^T @ op(A)^T, so the operands are swapped and
nothing is copied. float32, float16 and bfloat16 go through `cublasGemmEx` / `cublasGemmStridedBatchedEx` with
float32 accumulation (float32 may opt into TF32 tensor cores: `tf32=True`, compute type CUBLAS_COMPUTE_32F_FAST_TF32;
off by default, so float32 stays IEEE float32); float64 goes through `cublasDgemm` / `cublasDgemmStridedBatched`.
The handle is created on the executor's thread, in its context, and bound to the executor's stream.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from deepx_core.errors import DeepxError
from deepxd.kernels.cuda._libs import load

log = logging.getLogger(__name__)

# cudaDataType_t
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
# cublasComputeType_t
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F = 68, 77, 70
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1

DATA_TYPES = {"float32": CUDA_R_32F, "float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF, "float64": CUDA_R_64F}

_STATUS = {0: "SUCCESS", 1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
           11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED",
           16: "LICENSE_ERROR"}

_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """libcublas, found by name: $DEEPX_CUBLAS, then libcublas.so.13/.12, then whatever the loader finds."""
    global _lib
    if _lib is None:
        try:
            _lib = load("DEEPX_CUBLAS", ("libcublas.so.13", "libcublas.so.12", "libcublas.so"), "cublas", _declare,
                        "cuBLAS")
        except DeepxError as e:
            raise DeepxError(f"matmul: {e}") from None
    return _lib


def _declare(lib: ctypes.CDLL) -> None:
    vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasDestroy_v2.argtypes = [vp]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll,
                                               i, i, i]
    lib.cublasDgemm_v2.argtypes = [vp, i, i, i, i, i, vp, vp, i, vp, i, vp, vp, i]
    lib.cublasDgemmStridedBatched.argtypes = [vp, i, i, i, i, i, vp, vp, i, ll, vp, i, ll, vp, vp, i, ll, i]
    for name in ("cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2", "cublasGemmEx",
                 "cublasGemmStridedBatchedEx", "cublasDgemm_v2", "cublasDgemmStridedBatched"):
        getattr(lib, name).restype = ctypes.c_int


def _check(status: int, what: str) -> None:
    if status != 0:
        raise DeepxError(f"matmul: {what} failed with CUBLAS_STATUS_{_STATUS.get(status, status)}")


class Blas:
    """A cuBLAS handle bound to one stream. Create, use and close it on the thread that owns the context."""

    def __init__(self, stream_handle: int, *, tf32: bool = False) -> None:
        self.lib = library()
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        _check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream_handle)), "cublasSetStream")
        self.tf32 = tf32
        self._one_f, self._zero_f = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._one_d, self._zero_d = ctypes.c_double(1.0), ctypes.c_double(0.0)

    def close(self) -> None:
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()

    def gemm(self, dtype: str, m: int, n: int, k: int, a: int, b: int, c: int, *, trans_a: bool = False,
             trans_b: bool = False, batch: int = 1, stride_a: int = 0, stride_b: int = 0, stride_c: int = 0,
             lda: int | None = None, ldb: int | None = None, ldc: int | None = None) -> None:
        """Row-major C[m, n] = op(A) @ op(B) for `batch` matrices at element strides stride_a/b/c (0: one matrix
        shared by every product). op(A) is m x k: A is stored m x k, or k x m when trans_a. Pointers are device
        addresses."""
        if dtype not in DATA_TYPES:
            raise DeepxError(f"matmul: cuBLAS has no {dtype} GEMM here (float64 float32 float16 bfloat16)")
        if m == 0 or n == 0 or batch == 0:
            return
        lda = lda if lda is not None else (m if trans_a else k)
        ldb = ldb if ldb is not None else (k if trans_b else n)
        ldc = ldc if ldc is not None else n
        # column-major: C^T (n x m) = op(B)^T (n x k) @ op(A)^T (k x m)
        ob = CUBLAS_OP_T if trans_b else CUBLAS_OP_N
        oa = CUBLAS_OP_T if trans_a else CUBLAS_OP_N
        vp = ctypes.c_void_p
        h = self.handle
        if dtype == "float64":
            one, zero = ctypes.byref(self._one_d), ctypes.byref(self._zero_d)
            if batch == 1:
                st = self.lib.cublasDgemm_v2(h, ob, oa, n, m, k, one, vp(b), ldb, vp(a), lda, zero, vp(c), ldc)
            else:
                st = self.lib.cublasDgemmStridedBatched(h, ob, oa, n, m, k, one, vp(b), ldb, stride_b, vp(a), lda,
                                                        stride_a, zero, vp(c), ldc, stride_c, batch)
            _check(st, "cublasDgemm")
            return
        t = DATA_TYPES[dtype]
        compute = CUBLAS_COMPUTE_32F_FAST_TF32 if (self.tf32 and dtype == "float32") else CUBLAS_COMPUTE_32F
        one, zero = ctypes.byref(self._one_f), ctypes.byref(self._zero_f)
        if batch == 1:
            st = self.lib.cublasGemmEx(h, ob, oa, n, m, k, one, vp(b), t, ldb, vp(a), t, lda, zero, vp(c), t, ldc,
                                       compute, CUBLAS_GEMM_DEFAULT)
        else:
            st = self.lib.cublasGemmStridedBatchedEx(h, ob, oa, n, m, k, one, vp(b), t, ldb, stride_b, vp(a), t, lda,
                                                     stride_a, zero, vp(c), t, ldc, stride_c, batch, compute,
                                                     CUBLAS_GEMM_DEFAULT)
        _check(st, "cublasGemmEx")

