"""examples/quickstart.ipynb runs top to bottom in a real Jupyter kernel (ipykernel, driven by nbclient), as a
newcomer would run it, and its outputs say what the notebook promises (issue 27, item 9)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def stream_text(cell: Any, name: str = "stdout") -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", ()) if o.get("output_type") == "stream"
                   and o.get("name") == name)


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The notebook after a run in a fresh kernel whose working directory is a temporary one (where it saves), with
    this tree and examples/ (for bars.py, as when Jupyter opens the notebook there) on the kernel's path."""
    workdir = tmp_path_factory.mktemp("quickstart")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "examples"), os.environ.get("PYTHONPATH")) if p)
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", path)  # the kernel is a child process: it inherits this environment
    mp.delenv("DEEPX_ADDRESS", raising=False)  # the notebook's dx.connect() starts an embedded daemon
    try:
        # a cell that raises makes execute() raise CellExecutionError, naming the cell and the traceback
        NotebookClient(nb, kernel_name="python3", timeout=120, startup_timeout=60,
                       resources={"metadata": {"path": str(workdir)}}).execute()
    finally:
        mp.undo()
    return nb, workdir


def code_cells(nb: Any) -> list[Any]:
    return [c for c in nb.cells if c.cell_type == "code"]


def test_the_notebook_as_committed_has_no_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert all(not c.outputs and c.execution_count is None for c in code_cells(nb))


def test_every_cell_ran_and_nothing_warned(executed: tuple[Any, Path]) -> None:
    nb, _ = executed
    cells = code_cells(nb)
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1))
    for c in cells:
        assert not any(o.get("output_type") == "error" for o in c.outputs), c.source
        assert stream_text(c, "stderr") == "", (c.source, stream_text(c, "stderr"))  # e.g. "install ipywidgets"


def test_tensors_print_as_torch_prints_them(executed: tuple[Any, Path]) -> None:
    connect, tensors = (stream_text(c) for c in code_cells(executed[0])[:2])
    assert re.fullmatch(r"computes on a GPU: (True|False)\n", connect), connect
    assert re.fullmatch(re.escape("tensor([[ 1.,  3.,  5.],\n        [ 7.,  9., 11.]])\nsum 36.0 shape (2, 3) on ")
                        + r"(cpu|cuda:\d+)\n", tensors), tensors


def test_training_shows_a_bar_lowers_the_loss_and_learns(executed: tuple[Any, Path]) -> None:
    train, evaluate = (stream_text(c) for c in code_cells(executed[0])[2:4])
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", train)
    assert "epoch 6 loss" in plain and "100%" in plain  # the bar's last state
    first, last = map(float, re.search(r"first epoch loss (\d+\.\d+), last epoch loss (\d+\.\d+)", plain).groups())
    assert last < first / 4 and last < 0.3, (first, last)
    accuracy = float(re.fullmatch(r"test accuracy (\d\.\d+)\n", evaluate).group(1))
    assert accuracy >= 0.9


def test_the_weights_are_saved_as_safetensors(executed: tuple[Any, Path]) -> None:
    nb, workdir = executed
    saved = load_file(str(workdir / "quickstart.safetensors"))
    shapes = {"0.weight": (64, 64), "0.bias": (64,), "2.weight": (10, 64), "2.bias": (10,)}
    assert {k: a.shape for k, a in saved.items()} == shapes
    assert all(a.dtype == np.float32 and np.isfinite(a).all() and a.any() for a in saved.values())
    listed = stream_text(code_cells(nb)[4]).splitlines()
    assert sorted(listed) == sorted(f"{k} float32 {s}" for k, s in shapes.items())
