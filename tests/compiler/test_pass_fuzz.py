"""The default pipeline on random programs of transposes, products, fused ops, column sums, in-place writes and
deletions over a small pool of names (as a client that reuses names writes them): every tensor that exists after
the rewritten program exists after the program as written, with the same shape and value (float64, to rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.ir.instr import Instr
from deepx_core.ir.text import parse_text
from deepxd.compiler import DEFAULT_PASSES, PassContext, run_passes
from tests.compiler.helpers import executor

N = 6
MATRICES = ("m0", "m1", "m2", "m3", "m4")
VECTORS = ("v0", "v1")
T = "tensor<float64>"


def random_program(rng: np.random.Generator, length: int) -> list[Instr]:
    alive = {"a", "b"}
    lines: list[str] = []

    def some() -> str:
        return str(rng.choice(sorted(alive)))

    def target() -> str:
        return str(rng.choice(MATRICES))

    while len(lines) < length:
        kind = rng.integers(0, 9)
        if kind == 0 or kind == 1:  # a transpose, most often then read by a product and deleted
            src, t = some(), target()
            lines.append(f"transpose ({T}:{src}, vector<int32>:[1 0]) -> ({T}:{t})")
            alive.add(t)
            if rng.random() < 0.7:
                other = some()
                x, y = (t, other) if rng.random() < 0.5 else (other, t)
                out = target()
                lines.append(f"matmul ({T}:{x}, {T}:{y}) -> ({T}:{out})")
                alive.add(out)
                if rng.random() < 0.5 and out not in ("a", "b"):
                    lines.append(f"transpose ({T}:{out}, vector<int32>:[1 0]) -> ({T}:{target()})")
                    alive.add(lines[-1].split(":")[-1][:-1])
                if rng.random() < 0.8 and t in alive and t not in ("a", "b"):
                    lines.append(f"deltensor () -> ({T}:{t})")
                    alive.discard(t)
        elif kind == 2:
            out = target()
            lines.append(f"matmul ({T}:{some()}, {T}:{some()}) -> ({T}:{out})")
            alive.add(out)
        elif kind == 3:  # a ReLU's gradient, most often then its column sums
            out = target()
            lines.append(f"fused (listtensor<float64>:[{some()} {some()}], var<string>:in0 * (in1 > 0.0) + in0) -> "
                         f"({T}:{out})")
            alive.add(out)
            if rng.random() < 0.7:
                v = str(rng.choice(VECTORS))
                lines.append(f"sum ({T}:{out}, vector<int32>:[0], var<bool>:false) -> ({T}:{v})")
        elif kind == 4:
            x = some()
            lines.append(f"mulscalar ({T}:{x}, var<float64>:-0.5) -> ({T}:{x})")
        elif kind == 5:
            out = target()
            lines.append(f"relu ({T}:{some()}) -> ({T}:{out})")
            alive.add(out)
        elif kind in (6, 7):
            doomed = sorted(alive - {"a", "b"})
            if doomed:
                d = str(rng.choice(doomed))
                lines.append(f"deltensor () -> ({T}:{d})")
                alive.discard(d)
        else:
            out = target()
            lines.append(f"copytensor ({T}:{some()}) -> ({T}:{out})")
            alive.add(out)
    return parse_text("\n".join(lines))


@pytest.mark.parametrize("seed", range(40))
def test_random_programs_keep_every_value(seed):
    rng = np.random.default_rng(seed)
    inputs = {"a": rng.standard_normal((N, N)), "b": rng.standard_normal((N, N))}
    for _ in range(10):
        prog = random_program(rng, int(rng.integers(6, 18)))
        keep = frozenset({"a"}) if rng.random() < 0.3 else frozenset()
        plain = executor(inputs)
        plain.run_all(prog)
        fetch = frozenset(n for n in plain.tensors if rng.random() < 0.3)
        ctx = PassContext(metas=dict(executor(inputs).tensors.metas), fetch=fetch, keep=keep)
        after = run_passes(prog, ctx, DEFAULT_PASSES)
        assert len(ctx.origins) == len(after)
        rewritten = executor(inputs)
        rewritten.run_all(after)
        assert set(rewritten.tensors) == set(plain.tensors), "\n".join(map(str, prog))
        for n, want in plain.tensors.items():
            got = rewritten.tensors[n]
            assert got.shape == want.shape, n
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"{n}\n" + "\n".join(map(str, prog)))
