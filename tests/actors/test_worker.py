"""The op worker's whole-program check follows the program's effect on the set of tensors as the executor does: which
tensors a fetch finds after it, which heap tensors its deletes and renames would touch."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from deepx_core.ir.text import parse_text
from deepxd.actors.messages import Put, RunProgram
from deepxd.actors.opcpu import CpuWorker


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[CpuWorker]:
    w = CpuWorker(output_log=False, io_roots=[str(tmp_path)])
    w.start()
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    await w.ref.ask(Put(name="a", dtype="float32", shape=[2, 3], data=a.tobytes()))
    yield w
    await w.stop()


async def test_a_tensor_renamed_to_its_own_name_is_still_fetched(worker: CpuWorker) -> None:
    """A rename to the same name changes nothing; the fetch check took it for a rename away."""
    prog = parse_text("renametensor (var<string>:a) -> (tensor<float32>:a)\n"
                      "addscalar (tensor<float32>:a, var<float32>:1) -> (tensor<float32>:b)")
    r = await worker.ref.ask(RunProgram(program=prog, fetch=["a", "b"]))
    assert not r.error
    np.testing.assert_array_equal(r.tensors["b"], r.tensors["a"] + 1)


async def test_a_fetch_finds_what_the_program_makes_and_not_what_it_deletes_or_renames_away(
        worker: CpuWorker, tmp_path: Path) -> None:
    save = parse_text(f"save (tensor<float32>:a, var<string>:{tmp_path}/w.x) -> ()")
    assert not (await worker.ref.ask(RunProgram(program=save, fetch=[]))).error
    prog = parse_text(f"load (var<string>:{tmp_path}/w.x) -> ()\n"
                      "renametensor (var<string>:c) -> (tensor<float32>:a)")
    r = await worker.ref.ask(RunProgram(program=prog, fetch=["w.x", "c"]))
    assert not r.error and set(r.tensors) == {"w.x", "c"}
    for gone in ("a", "s"):  # renamed away; a variable's name, not a tensor's
        r = await worker.ref.ask(RunProgram(program=parse_text("argset (var<float32>:2) -> (var<string>:s)"),
                                 fetch=[gone]))
        assert r.error == f"fetch: tensor '{gone}' not found" and r.done == 0
