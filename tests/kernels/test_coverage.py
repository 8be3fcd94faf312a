"""Every op of the catalogue is checked against a reference by some test in this folder, as the tests themselves
say: an op counts as covered where a test function names it (a string in its body, or in its parametrization), or
a helper of its module that it calls does. Deleting the last test of an op makes this fail."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

from deepx_core.ir.ops import OPS
from deepxd.kernels.cpu import KERNELS


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a parametrize argument (values, tuples of them, pytest.param sets)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            yield from _strings(v)
    elif type(value).__name__ == "ParameterSet":
        yield from _strings(value.values)


def _named(fn: FunctionType, module: ModuleType, seen: set[str]) -> set[str]:
    """The strings a function's source holds (and the words of each), with those of the module's own functions it
    calls, followed transitively."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
            names.update(node.value.split())
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in seen:
            helper = getattr(module, node.func.id, None)
            if isinstance(helper, FunctionType) and helper.__module__ == module.__name__:
                seen.add(node.func.id)
                names |= _named(helper, module, seen)
    return names


def covered() -> dict[str, list[str]]:
    """op -> the tests of this folder that name it."""
    found: dict[str, list[str]] = {}
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if path.stem == Path(__file__).stem:
            continue
        module = importlib.import_module(path.stem)
        for name, fn in vars(module).items():
            if not (name.startswith("test_") and isinstance(fn, FunctionType)):
                continue
            names = _named(fn, module, {name})
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "parametrize":
                    names.update(_strings(mark.args[1]))
            for op in OPS:
                if op in names:
                    found.setdefault(op, []).append(f"{path.stem}.{name}")
    return found


def test_every_op_has_a_reference_test() -> None:
    missing = sorted(set(OPS) - set(covered()))
    assert not missing, f"ops no test in tests/kernels names: {missing}"


def test_every_op_has_a_cpu_kernel() -> None:
    assert all(callable(KERNELS[name]) for name in OPS)
