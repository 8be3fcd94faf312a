"""Every op of the catalogue is checked against a reference by some test in this folder."""

from __future__ import annotations

import importlib
from pathlib import Path

from kernel_ref import COVERED

from deepx_core.ir.ops import OPS
from deepxd.kernels.cpu import KERNELS


def test_every_op_has_a_reference_test():
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if path.stem != Path(__file__).stem:
            importlib.import_module(path.stem)  # each module registers what it covers when imported
    missing = sorted(set(OPS) - COVERED)
    assert not missing, f"ops with no reference test: {missing}"
    assert not COVERED - set(OPS), f"covered names that are not ops: {sorted(COVERED - set(OPS))}"


def test_every_op_has_a_cpu_kernel():
    assert all(callable(KERNELS[name]) for name in OPS)
