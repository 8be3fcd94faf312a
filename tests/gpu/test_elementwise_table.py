"""Every elementwise op of the table (the kernels rendered from each op's `expr`, and the few special forms) x every
dtype it claims, on the device against the CPU, special values included (nan, infinities, signed zeros, halves,
integer extremes that wrap): the executor the op-cuda worker runs against the op-cpu worker's kernels, contiguous
(16-byte packs and the scalar tail), off a 16-byte boundary (scalar loads), broadcast (the strided kernel), empty and
in place, with no CPU fallback; then one program per dtype through an embedded daemon whose op worker is op-cuda
against one whose op worker is op-cpu. An op added in the test alone runs as a kernel of its own, with its scalar.
tests/kernels/test_cuda_source.py checks the rendered C without a GPU."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from deepx_core.ir.dtypes import FLOATS, INTS, to_numpy
from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import OPS, elementwise, op, remove_op
from deepx_core.ir.ops import t as targ
from deepx_core.ir.ops import v as varg
from deepxd.kernels.cpu import CpuExecutor
from deepxd.kernels.cuda import elementwise as ew
from tests.gpu.test_kernels import compare
from tests.kernels.kernel_ref import L, T, V, instr, ordered

OPS_HERE = sorted(name for name in ew.SUPPORT if name != "todtype")
N = 1031  # four-element packs and a tail of three


def _params() -> list[Any]:
    return [pytest.param(name, dt, id=f"{name}-{dt}") for name in OPS_HERE for dt in ordered(OPS[name].dtypes)]


def _specials(dtype: str, name: str) -> np.ndarray:
    if dtype == "bool":
        return np.array([True, False])
    if dtype in INTS:
        info = np.iinfo(to_numpy(dtype))
        wraps = name in ("add", "sub", "mul", "neg", "abs", "max", "min", "less", "greater", "equal", "notequal")
        extremes = [info.min, info.max, info.min + 1] if wraps and dtype != "int64" else []
        return np.array([0, 1, -1, 2, -2, 7, -7, *extremes], dtype=to_numpy(dtype))
    values = [0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 1e-3, 30.0, float("nan")]
    if name != "gelu":  # gelu's two kernels meet the infinities differently (-inf * 0)
        values += [float("inf"), float("-inf")]
    return np.array(values, dtype=to_numpy(dtype))


def _values(rng: np.random.Generator, dtype: str, name: str, n: int, which: int) -> np.ndarray:
    """n values of `dtype` for the op's tensor number `which`, its special values first, then random ones in a
    range where the CPU and the device must agree (integers: no zero divisor, no NaN cast to an integer)."""
    if dtype == "bool":
        out = rng.random(n) < 0.5
    elif dtype in INTS:
        lo, hi = (-3, 3) if name in ("pow", "powscalar", "rpowscalar") else (-50, 50)
        if (name == "pow" and which == 1) or name in ("rpowscalar", "powscalar"):
            lo = 0  # a negative exponent computes in float64; a NaN from a negative base has no integer value
        out = rng.integers(lo, hi + 1, n).astype(to_numpy(dtype))
        special = _specials(dtype, name)
        if name in ("pow", "powscalar", "rpowscalar"):
            special = special[(special >= 0) | (which == 0 and name == "pow")]
        out[:len(special)] = special[:n]
        if name in ("div", "rdivscalar") and which == (1 if name == "div" else 0):
            out[out == 0] = 3  # integer division by zero is an error (tests/gpu/test_kernels_extra.py)
    else:
        out = rng.uniform(-3, 3, n).astype(to_numpy(dtype))
        special = _specials(dtype, name)
        special = np.roll(special, which)  # a different special beside each
        out[:len(special)] = special[:n]
    return out


def _scalars(name: str, dtype: str) -> list[Any]:
    if name in ("gelu", "gelugrad", "equal", "notequal"):  # their args besides the tensors are not a scalar operand
        return [None]
    if name.startswith(("equal", "notequal")):
        return [0, 1] if dtype == "bool" else [1, -1.5] if dtype in FLOATS else [2, 2.5, -1000]
    if dtype in INTS:
        if name == "divscalar":
            return [3, -7, 2.5]
        if name == "rdivscalar":
            return [7, -2.5]
        if name == "powscalar":
            return [2, 0]
        if name == "rpowscalar":
            return [2, 3, 1.5]
        return [3, -2.5, 1000]  # beyond int8: computed in int64 and wrapped, as on the CPU
    if name == "rpowscalar":
        return [1.5, 0.5]
    return [1.5, -2, -0.5]


def _cases(name: str, dtype: str, rng: np.random.Generator) -> Iterator[tuple[str, dict[str, np.ndarray], Instr]]:
    """(what, inputs, instruction) for each layout and scalar."""
    d = OPS[name]
    tensors = [a.name for a in d.args if a.kind == "tensor"]
    scalars = _scalars(name, dtype) if any(a.kind == "var" for a in d.args) else [None]
    if name in ("gelu", "gelugrad"):  # gelugrad: gelu's input and the gradient of its output, of one shape
        inputs = {n: _values(rng, dtype, name, N, k) for k, n in enumerate(tensors)}
        for form in ("none", "tanh"):
            ins = instr(name, [*(T(n) for n in tensors), V(form)], [T("C")])
            yield f"contiguous approximate={form}", inputs, ins
            yield f"empty approximate={form}", {n: a[:0] for n, a in inputs.items()}, ins
        return
    out_dtype = "bool" if d.returns[0].dtypes == frozenset({"bool"}) else None
    for s in scalars:
        layouts: list[tuple[str, list[tuple[int, ...]]]] = [("contiguous", [(N,)] * len(tensors)),
                                                            ("empty", [(0, 3)] * len(tensors))]
        if len(tensors) == 2:
            layouts.append(("broadcast", [(3, 1, 5), (4, 1)]))
        for what, shapes in layouts:
            inputs = {n: _values(rng, dtype, name, int(np.prod(sh)), k).reshape(sh)
                      for k, (n, sh) in enumerate(zip(tensors, shapes))}
            for inplace in (False, True) if what == "contiguous" and out_dtype is None else (False,):
                args: list[Any] = []
                for a in d.args:
                    if a.kind == "tensor":
                        args.append(T(a.name))
                    elif a.name == "eps":
                        args.append(V(0.5 if name.endswith("scalar") or dtype != "bool" else 0))
                    else:
                        args.append(V(s))
                ret = T(tensors[0] if inplace else "C", out_dtype)
                yield f"{what}{' in place' if inplace else ''} s={s!r}", inputs, instr(name, args, [ret])
        if name in ("equal", "notequal", "equalscalar", "notequalscalar"):  # eps 0: exact
            inputs = {n: _values(rng, dtype, name, N, k) for k, n in enumerate(tensors)}
            args = [T(n) for n in tensors] + ([V(s)] if s is not None and name.endswith("scalar") else []) + [V(0)]
            yield f"eps 0 s={s!r}", inputs, instr(name, args, [T("C", "bool")])


def _unaligned(gx: Any, name: str, a: np.ndarray) -> None:
    """`a` on the device one element past a 16-byte boundary (a view into other memory): the kernels' scalar loads."""
    from deepxd.kernels.cuda import DeviceTensor

    buf = gx.alloc(a.nbytes + 64, "test", name)
    t = DeviceTensor(buf, int(buf) + a.dtype.itemsize, a.shape, a.dtype)
    gx.write(t, a)
    gx.tensors[name] = t


def _outputs(i: Instr) -> list[str]:
    return [str(p.value) for p in i.returns]


@pytest.mark.parametrize(("name", "dtype"), _params())
def test_every_elementwise_op_and_dtype_matches_the_cpu(gx, name, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{name}-{dtype}".encode()))
    for k, (what, inputs, ins) in enumerate(_cases(name, dtype, rng)):
        for unaligned in (False, True) if what.startswith("contiguous") else (False,):
            gx.tensors.clear()
            cpu = CpuExecutor()
            for n, a in inputs.items():
                cpu.put(n, a)
                if unaligned:
                    _unaligned(gx, n, a)
                else:
                    gx.put(n, a)
            cpu.run(ins)
            gx.run(ins)
            label = f"{name}[{dtype}] case {k} ({what}{', unaligned' if unaligned else ''})"
            for out in _outputs(ins):
                compare(gx.get(out), cpu.get(out), dtype, "elem", label)
            assert not gx.fallbacks, f"{label}: ran on the CPU fallback: {dict(gx.fallbacks)}"


def _worker_program(dtype: str, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], list[Instr], list[str]]:
    """One program of every elementwise op that claims `dtype`, each on contiguous inputs with special values."""
    inputs: dict[str, np.ndarray] = {}
    prog: list[Instr] = []
    fetch: list[str] = []
    for name in OPS_HERE:
        if dtype not in OPS[name].dtypes:
            continue
        _, ins_values, ins = next(iter(_cases(name, dtype, rng)))
        renames = {n: f"{name}_{n}" for n in ins_values}
        for n, a in ins_values.items():
            inputs[renames[n]] = a
        args = tuple(p._replace(value=renames.get(str(p.value), p.value)) if p.category == "tensor" else p
                     for p in ins.args)
        out = f"{name}_out"
        prog.append(ins._replace(args=args, returns=(ins.returns[0]._replace(value=out),)))
        fetch.append(out)
    return inputs, prog, fetch


@pytest.mark.parametrize("dtype", ordered({d for name in OPS_HERE for d in OPS[name].dtypes}))
def test_the_op_cuda_worker_gives_what_the_op_cpu_worker_gives(cuda_session, dtype, monkeypatch):
    import deepx_sdk as dx

    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    monkeypatch.delenv("DEEPX_ROLES", raising=False)
    rng = np.random.default_rng(zlib.crc32(dtype.encode()))
    inputs, prog, fetch = _worker_program(dtype, rng)
    results = {}
    try:
        for role in ("op-cuda", "op-cpu"):
            s = dx.connect(roles=["heapmem", role])
            assert s.transport.embedded.config.roles[:2] == ["heapmem", role]
            for n, a in inputs.items():
                s.transport.put(n, a, heap=False)
            out = s.transport.run(prog, fetch)
            assert out.ok, f"{role}: {out.error}"
            results[role] = out.tensors
    finally:
        dx.disconnect()
    for name in fetch:
        compare(results["op-cuda"][name], results["op-cpu"][name], dtype, "elem", f"{name} [{dtype}] on op-cuda")


@pytest.fixture
def lerp() -> Iterator[Any]:
    entry = op("lerp_t", "expr", [targ("A"), targ("B"), varg("w")], [targ("C")], FLOATS, elementwise(0, 1),
               "A + w (B - A)", deepxir=False, expr="A + w * (B - A)")
    yield entry
    remove_op("lerp_t")


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_an_op_added_in_one_entry_runs_as_its_own_kernel(gx, lerp, dtype):
    rng = np.random.default_rng(5)
    a = rng.uniform(-2, 2, (33, 65)).astype(to_numpy(dtype))
    b = rng.uniform(-2, 2, (65,)).astype(to_numpy(dtype))
    for shape_b, w in (((33, 65), 0.25), ((65,), -1.5)):
        gx.tensors.clear()
        bb = np.broadcast_to(b, shape_b).copy()
        gx.put("A", a)
        gx.put("B", bb)
        gx.run(instr("lerp_t", [T("A"), T("B"), V(w)], [T("C")]))
        assert not gx.fallbacks, dict(gx.fallbacks)
        want = a.astype(np.float64) + w * (bb.astype(np.float64) - a.astype(np.float64))
        tol = {"float64": 1e-12, "float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
        np.testing.assert_allclose(gx.get("C").astype(np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_the_functions_the_fused_language_gained_run_fused_on_the_device(gx, dtype):
    """floor, ceil, round (halves to even), trunc, log1p and expm1 in a fused expression, against the CPU's fused
    kernel on the same inputs (halves and signed zeros among them)."""
    rng = np.random.default_rng(9)
    a = np.concatenate([np.arange(-20, 21) / 2, [-0.0, 0.25, -0.25], rng.uniform(-4, 4, 400)]).astype(to_numpy(dtype))
    b = rng.uniform(-0.9, 4, a.shape).astype(to_numpy(dtype))
    ins = instr("fused", [L(["a", "b"]), V("floor(in0) + ceil(in1) * 2 - round(in0) * trunc(in1) + log1p(in1) "
                                         "- expm1(in0 * 0.25)")], [T("y")])
    cpu = CpuExecutor()
    for n, x in (("a", a), ("b", b)):
        cpu.put(n, x)
        gx.put(n, x)
    cpu.run(ins)
    gx.run(ins)
    compare(gx.get("y"), cpu.get("y"), dtype, "elem", f"fused [{dtype}]")
    r = instr("fused", [L(["a"]), V("round(in0)")], [T("r")])
    cpu.run(r)
    gx.run(r)
    np.testing.assert_array_equal(gx.get("r"), cpu.get("r"))  # exact: halves to even on both
    assert not gx.fallbacks
