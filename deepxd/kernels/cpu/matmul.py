"""Matrix multiply, batched over broadcast leading dims. Every author (cblas, cublas, miaobyte) reaches this kernel:
numpy's matmul calls BLAS for float32 and float64; low-precision floats multiply in float32."""

from __future__ import annotations

import numpy as np

from deepxd.kernels.cpu._util import LOW, up


def matmul(a, b, out):
    if out.dtype in LOW:
        out[...] = np.matmul(up(a), up(b))
    else:
        np.matmul(a, b, out=out)
