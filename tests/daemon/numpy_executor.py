"""The executor tests/daemon/test_executor.py runs in a process of its own: examples/executor_numpy.py's ops, and two
for the tests: `slowcopy` (says it began in a file, then sleeps: a call to kill the executor in) and `attached` (how
many tensors it read from the node's shared memory, not from their bytes sent).

    python tests/daemon/numpy_executor.py ADDRESS [--name NAME] [--token-file PATH] [--marker DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import time
from pathlib import Path

import numpy as np

from deepx_sdk.executor import op

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "executor_numpy.py"
_spec = importlib.util.spec_from_file_location("executor_numpy", EXAMPLE)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


class TestExecutor(example.NumpyExtra):
    def __init__(self, name: str, marker: Path | None) -> None:
        super().__init__(name)
        self.marker = marker

    @op(args=["tensor A", "var seconds"], returns=["tensor C"], results={"C": "like A"}, cost_us=10)
    def slowcopy(self, A: np.ndarray, seconds: float) -> np.ndarray:
        """A copy of A, after `seconds`."""
        if self.marker is not None:
            (self.marker / "slow-began").write_text("")
        time.sleep(seconds)
        return A.copy()

    @op(args=["tensor A"], returns=["tensor C"], results={"C": {"shape": [], "dtype": "int64"}}, cost_us=10)
    def attached(self, A: np.ndarray) -> np.ndarray:
        """How many tensors this executor has read from the node's shared memory (A among them, where it is a heap
        tensor)."""
        return np.int64(self.attached)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--name", default="numpy-extra")
    parser.add_argument("--token-file")
    parser.add_argument("--marker")
    a = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    token = Path(a.token_file).read_text().strip() if a.token_file else None
    TestExecutor(a.name, Path(a.marker) if a.marker else None).serve(a.address, token=token)


if __name__ == "__main__":
    main()
