"""Helpers for the pass tests: programs written as deepxIR text, a pass run against the tensors of a CpuExecutor,
and both versions of a program run on random inputs and compared."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from deepx_core.ir.dtypes import to_numpy
from deepx_core.ir.instr import Instr
from deepx_core.ir.text import format_text, parse_text
from deepxd.compiler import PassContext
from deepxd.kernels.cpu import CpuExecutor

#: (rtol, atol) for comparing a rewritten program's results with the original's
TOL = {"float64": (1e-12, 1e-12), "float32": (2e-6, 1e-6), "float16": (2e-3, 1e-3), "bfloat16": (1.6e-2, 1e-2)}


def program(text: str) -> list[Instr]:
    return parse_text(textwrap.dedent(text).strip())


def lines(prog: list[Instr]) -> list[str]:
    return [format_text(i) for i in prog]


def executor(inputs: Mapping[str, np.ndarray]) -> CpuExecutor:
    ex = CpuExecutor()
    for name, a in inputs.items():
        ex.put(name, a)
    return ex


def context(inputs: Mapping[str, np.ndarray], fetch: Collection[str] = (), **kw) -> PassContext:
    """A context for a program that runs on an executor holding `inputs`."""
    return PassContext(metas=dict(executor(inputs).tensors.metas), fetch=frozenset(fetch), **kw)


def random_inputs(rng: np.random.Generator, shapes: Mapping[str, tuple[int, ...]], dtype: str = "float32",
                  lo: float = 0.5, hi: float = 2.0) -> dict[str, np.ndarray]:
    return {n: rng.uniform(lo, hi, s).astype(to_numpy(dtype)) for n, s in shapes.items()}


def rewrite(fn: Callable[[list[Instr], PassContext], list[Instr]], text: str, inputs: Mapping[str, np.ndarray],
            fetch: Collection[str] = (), **kw) -> tuple[list[Instr], list[Instr], PassContext]:
    before = program(text)
    ctx = context(inputs, fetch, **kw)
    after = fn(list(before), ctx)
    return before, after, ctx


def assert_same_results(before: list[Instr], after: list[Instr], inputs: Mapping[str, np.ndarray],
                        tol: tuple[float, float] | None = None) -> dict[str, np.ndarray]:
    """Both programs run on executors holding `inputs`: the same tensors exist afterwards, with the same shapes,
    dtypes and (within the dtype's tolerance) values. Returns the original's tensors."""
    ex1, ex2 = executor(inputs), executor(inputs)
    ex1.run_all(before)
    ex2.run_all(after)
    assert set(ex1.tensors) == set(ex2.tensors), (sorted(ex1.tensors), sorted(ex2.tensors))
    for name, want in ex1.tensors.items():
        got = ex2.tensors[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        rtol, atol = tol or TOL.get(str(want.dtype), (0, 0))
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol,
                                   err_msg=name)
    return dict(ex1.tensors)


def execute_threads(worker: Any) -> set[str]:
    """The names of the threads the worker's executor runs instructions on, from here on (a spy on its execute)."""
    import threading

    threads: set[str] = set()
    run = worker.ex.execute

    def spy(b):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return run(b)

    worker.ex.execute = spy
    return threads
