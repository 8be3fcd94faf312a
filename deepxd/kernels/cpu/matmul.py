"""Matrix multiply, batched over broadcast leading dims. Every author (cblas, cublas, miaobyte) reaches this kernel:
float32 and float64 go to MKL where it is in use (blas.py) and the product is not tiny, else to numpy's matmul, which
calls numpy's BLAS; low-precision floats multiply in float32. matmultransposed reads an operand through a view with
its last two dims swapped, which BLAS reads transposed: no copy."""

from __future__ import annotations

import numpy as np

from deepxd.kernels.cpu._util import LOW, up
from deepxd.kernels.cpu.blas import gemm

#: products of fewer multiply-adds go to numpy's matmul: MKL through ctypes, with gemm's checks, costs 5-15 us a call
#: where numpy takes 1-4 (a decoding step's 1 x 64 @ 64 x 176; docs/decisions/0048); OpenBLAS runs them on one thread
TINY_WORK = 1 << 15


def matmul(a, b, out):
    if out.dtype in LOW:
        out[...] = np.matmul(up(a), up(b))
    elif out.size * a.shape[-1] < TINY_WORK or not gemm(a, b, out):
        np.matmul(a, b, out=out)


def matmultransposed(a, b, transpose_a, transpose_b, out):
    matmul(np.swapaxes(a, -1, -2) if transpose_a else a, np.swapaxes(b, -1, -2) if transpose_b else b, out)
