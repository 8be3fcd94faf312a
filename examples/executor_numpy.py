"""An executor of another process (docs/executor.md): ops written with numpy, served to a running deepxd.

    python examples/executor_numpy.py                      # the default socket (DEEPX_ADDRESS to choose another)
    python examples/executor_numpy.py tcp://10.0.0.5:7070  # DEEPX_TOKEN (or DEEPX_TOKEN_FILE) holds the token

Then, from any client of that node:

    from deepx_core.client import NativeClient
    from deepx_core.ir import parse_text
    c = NativeClient()
    c.put("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    c.run(parse_text("cummax (tensor<float32>:x, var<int32>:1) -> (tensor<float32>:y)"), fetch=["y"]).tensors["y"]

`cummax` and `outer` are new ops, declared here; `mul` is an op of the catalogue, which this executor runs in place
of the node's kernel where an instruction names it (`// executor=numpy-extra`).
"""

from __future__ import annotations

import logging
import sys

import numpy as np

from deepx_sdk.executor import Executor, op


class NumpyExtra(Executor):
    name = "numpy-extra"

    @op(args=["tensor A", "var<int> axis"], returns=["tensor C"], results={"C": "like A"},
        dtypes=["float32", "float64", "int32", "int64"], cost_us=40)
    def cummax(self, A: np.ndarray, axis: int) -> np.ndarray:
        """The running maximum along an axis (numpy.maximum.accumulate)."""
        return np.maximum.accumulate(A, axis=axis)

    @op(args=["tensor A", "tensor B"], returns=["tensor C"], results={"C": {"shape": ["A.0", "B.0"], "dtype": "A"}},
        dtypes=["float32", "float64"], cost_us=40)
    def outer(self, A: np.ndarray, B: np.ndarray) -> np.ndarray:
        """Outer product of two vectors (numpy.outer)."""
        return np.outer(A, B)

    @op()
    def mul(self, A: np.ndarray, B: np.ndarray) -> np.ndarray:
        return np.multiply(A, B)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    NumpyExtra().serve(sys.argv[1] if len(sys.argv) > 1 else None)
