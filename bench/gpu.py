"""op-cuda against torch on the same GPU, in one run. Every figure is a ratio against torch measured here.

1. float32 add at 256M elements: memory bandwidth (one `add` instruction with benchmark.repeat, then a sync) against
   torch.add(out=). Aim: at least 0.9x torch's bandwidth.
2. GEMM 8192 x 8192 x 8192, float32 (IEEE) and TF32: one `matmul` instruction with benchmark.repeat against
   torch.mm(out=). Aim: at least 0.9x torch's FLOP/s.
3. A 6-op elementwise chain y = |exp(x * a + b) * 0.5 - d| on 256M float32 elements, sent as a client records it
   (six instructions and five deltensors; the scheduler's passes fuse it into one instruction) against torch eager,
   unfused. Aim: at least 2x faster than torch.
4. Batched tiny-op dispatch: one program of 10,000 instructions on 1K-element tensors, sent over the daemon's Unix
   socket, run and synchronised; microseconds per instruction, against the same 10,000 torch eager ops on the GPU.
   Aim: at most 20 us per instruction.
5. The MLP training step of bench/train.py (784-512-512-10, batch 256, SGD with momentum) through the SDK on op-cuda:
   eager and under dx.compile, each with op-cuda's CUDA graphs (`cuda_graphs`, on by default) and without, against
   torch eager on the GPU and against torch's own CUDA-graph replay of the step (`torch.cuda.CUDAGraph`, the ceiling).
6. The character transformer of examples/train_transformer.py (its size, and d_model 256, 4 layers, context 128,
   batch 32): a warm step as its script takes one, eager and under dx.compile, graphs on and off, against torch eager.

deepx runs in an embedded daemon with op-cuda (`dx.connect(roles=["heapmem", "op-cuda"])`). Prints a markdown table
and saves it (and the numbers as JSON) under $OUT, else bench/results/.

    python bench/gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from deepx_core.ir import Instr, Param
from deepx_core.ir.text import parse_text
from deepxd.actors.messages import Fetch, OpStats, Run, Sync, Tf32

T = Param.tensor


def best(fn: Callable[[], object], repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


class Deepx:
    """The embedded daemon with op-cuda, driven the way a client drives it."""

    def __init__(self) -> None:
        import deepx_sdk as dx

        self.session = dx.connect(roles=["heapmem", "op-cuda"])
        self.transport: Any = self.session.transport
        self.node = self.transport.node

    def run(self, program: list[Instr], fetch: tuple[str, ...] = ()) -> Any:
        r = self.transport._call(self.node.ref("scheduler").ask(Run(program=program, fetch=list(fetch))))
        if r.error:
            raise RuntimeError(r.error)
        return r

    def ask(self, message: Any) -> Any:
        """The op-cuda worker's answer to `message` (deepxd/actors/messages.py)."""
        return self.transport._call(self.node.ref("op-cuda").ask(message))

    def sync(self) -> None:
        self.ask(Sync())

    def put(self, name: str, array: np.ndarray) -> None:
        self.transport.put(name, array, False)

    def delete(self, *names: str) -> None:
        self.run([Instr("deltensor", (), (T(n),)) for n in names])

    def graphs(self, on: bool) -> None:
        """op-cuda's CUDA graphs on or off from here (the `cuda_graphs` setting; plans captured stay captured)."""
        self.node.ref("op-cuda")._actor.graphs = on

    def fallbacks(self) -> dict[str, int]:
        stats = self.ask(OpStats())
        return {op: int(s["calls"]) for op, s in stats.items() if op.endswith("(cpu fallback)")}


def bench_add(dx: Deepx, torch: Any, n: int, reps: int) -> dict[str, float]:
    dx.put("ba", np.ones(n, np.float32))
    dx.put("bb", np.full(n, 2, np.float32))
    add = parse_text(f"add (tensor:ba, tensor:bb) -> (tensor:bc) // benchmark.repeat={reps}")

    def deepx() -> None:
        dx.run(add)
        dx.sync()

    deepx()
    t_dx = best(deepx, 3) / reps
    dx.delete("ba", "bb", "bc")
    a, b, c = (torch.ones(n, device="cuda") for _ in range(3))

    def eager() -> None:
        for _ in range(reps):
            torch.add(a, b, out=c)
        torch.cuda.synchronize()

    eager()
    t_t = best(eager, 3) / reps
    gb = 3 * n * 4 / 1e9
    return {"deepx": gb / t_dx, "torch": gb / t_t}


def bench_gemm(dx: Deepx, torch: Any, n: int, reps: int, tf32: bool) -> dict[str, float]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, n), dtype=np.float32)
    w = rng.standard_normal((n, n), dtype=np.float32)
    dx.put("gx", x)
    dx.put("gw", w)
    dx.ask(Tf32(on=tf32))
    mm = parse_text(f"matmul (tensor:gx, tensor:gw) -> (tensor:gy) // benchmark.repeat={reps}")

    def deepx() -> None:
        dx.run(mm)
        dx.sync()

    deepx()
    t_dx = best(deepx, 3) / reps
    dx.ask(Tf32(on=False))
    dx.delete("gx", "gw", "gy")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    tx, tw = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
    ty = torch.empty_like(tx)

    def eager() -> None:
        for _ in range(reps):
            torch.mm(tx, tw, out=ty)
        torch.cuda.synchronize()

    eager()
    t_t = best(eager, 3) / reps
    torch.backends.cuda.matmul.allow_tf32 = False
    flop = 2 * n**3 / 1e12
    return {"deepx": flop / t_dx, "torch": flop / t_t}


def chain(out: str = "cy") -> list[Instr]:
    """y = |exp(x * a + b) * 0.5 - d| as a client records it: each temporary deleted once the next op has read it."""
    f = "float32"
    t1, t2, t3, t4, t5 = (f"ct{k}" for k in range(1, 6))
    ops = [
        Instr("mul", (T("cx", f), T("ca", f)), (T(t1, f),)),
        Instr("add", (T(t1, f), T("cb", f)), (T(t2, f),)),
        Instr("exp", (T(t2, f),), (T(t3, f),)),
        Instr("mulscalar", (T(t3, f), Param.var(0.5)), (T(t4, f),)),
        Instr("sub", (T(t4, f), T("cd", f)), (T(t5, f),)),
        Instr("abs", (T(t5, f),), (T(out, f),)),
    ]
    prog = [ops[0]]
    for k, instr in enumerate(ops[1:]):
        prog += [instr, Instr("deltensor", (), (T((t1, t2, t3, t4, t5)[k], f),))]
    return prog


def bench_chain(dx: Deepx, torch: Any, n: int, reps: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    base = rng.standard_normal(n, dtype=np.float32) * 0.5
    host = {"cx": base, "ca": base[::-1].copy(), "cb": base * 0.3, "cd": base * 0.7}
    for k, v in host.items():
        dx.put(k, v)
    prog = chain()
    before = dict(dx.ask(OpStats()))
    dx.run(prog)
    dx.sync()
    after = dx.ask(OpStats())
    ran = {op: int(s["calls"]) - int(before.get(op, {}).get("calls", 0)) for op, s in after.items()}
    ran = {op: c for op, c in ran.items() if c and op != "deltensor"}
    y = dx.ask(Fetch(names=["cy"]))["cy"]
    x, a, b, d = (torch.from_numpy(host[k]).cuda() for k in ("cx", "ca", "cb", "cd"))
    ty = torch.abs(torch.exp(x * a + b) * 0.5 - d).cpu().numpy()
    err = float(np.max(np.abs(y - ty)) / np.max(np.abs(ty)))
    del ty

    def deepx() -> None:
        for _ in range(reps):
            dx.run(prog)
        dx.sync()

    def eager() -> None:
        for _ in range(reps):
            torch.abs(torch.exp(x * a + b) * 0.5 - d)
        torch.cuda.synchronize()

    deepx()
    eager()
    t_dx = best(deepx, 3) / reps
    t_t = best(eager, 3) / reps
    dx.delete("cx", "ca", "cb", "cd", "cy")
    return {"deepx": t_dx, "torch": t_t, "ran": ran, "max_rel_err": err}


def bench_dispatch(dx: Deepx, torch: Any, count: int, size: int = 1024) -> dict[str, float]:
    from deepx_sdk.client import NativeClient

    f = "float32"
    prog: list[Instr] = []
    for i in range(count):
        k = i % 4
        out = (T(f"do{i}", f),)
        if k == 0:
            prog.append(Instr("add", (T("da", f), T("db", f)), out))
        elif k == 1:
            prog.append(Instr("mul", (T("da", f), T("db", f)), out))
        elif k == 2:
            prog.append(Instr("addscalar", (T("da", f), Param.var(1.0)), out))
        else:
            prog.append(Instr("sub", (T("da", f), T("db", f)), out))
    a = np.random.default_rng(2).standard_normal(size, dtype=np.float32)
    with NativeClient(dx.transport.address, timeout=300) as c:
        c.put("da", a)
        c.put("db", a * 2)
        c.run(prog).raise_for_error()  # outputs made; from here every run writes into them

        def deepx() -> None:
            c.run(prog).raise_for_error()
            dx.sync()

        t_dx = best(deepx, 5) / count
    dx.delete("da", "db", *(f"do{i}" for i in range(count)))
    ta = torch.from_numpy(a).cuda()
    tb = ta * 2
    outs = [torch.empty_like(ta) for _ in range(count)]

    def eager() -> None:
        for i in range(count):
            k = i % 4
            if k == 0:
                torch.add(ta, tb, out=outs[i])
            elif k == 1:
                torch.mul(ta, tb, out=outs[i])
            elif k == 2:
                torch.add(ta, 1.0, out=outs[i])
            else:
                torch.sub(ta, tb, out=outs[i])
        torch.cuda.synchronize()

    eager()
    t_t = best(eager, 5) / count
    return {"deepx": t_dx * 1e6, "torch": t_t * 1e6}


def bench_mlp(dx: Deepx, torch: Any, steps: int) -> dict[str, float]:
    import deepx_sdk as dxs
    import deepx_sdk.nn as nn
    import deepx_sdk.nn.functional as F
    from deepx_sdk.optim import SGD

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 784)).astype(np.float32)
    y = rng.integers(0, 10, 256)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    dxx, dxy = dxs.tensor(x), dxs.tensor(y)

    def dx_step() -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(dxx), dxy)
        loss.backward()
        opt.step()
        return loss.item()

    # the same step as a stored graph (dx.compile): captured once, then replayed by name (as bench/train.py)
    cmodel = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    copt = SGD(cmodel.parameters(), lr=0.01, momentum=0.9)

    @dxs.compile
    def train_step(x: Any, y: Any) -> Any:
        copt.zero_grad()
        loss = F.cross_entropy(cmodel(x), y)
        loss.backward()
        copt.step()
        return loss

    def dx_compiled_step() -> float:
        return float(train_step(dxx, dxy).item())

    tmodel = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                 torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.01, momentum=0.9)
    tx, ty = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()

    def torch_step() -> float:
        topt.zero_grad()
        loss = torch.nn.functional.cross_entropy(tmodel(tx), ty)
        loss.backward()
        topt.step()
        return float(loss.item())

    # torch's whole-step CUDA graph, as its documentation captures one (warm-up on a side stream, static inputs)
    gmodel = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                 torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    gopt = torch.optim.SGD(gmodel.parameters(), lr=0.01, momentum=0.9)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            gopt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(gmodel(tx), ty).backward()
            gopt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    gopt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = torch.nn.functional.cross_entropy(gmodel(tx), ty)
        static_loss.backward()
        gopt.step()

    def torch_graph_step() -> float:
        graph.replay()
        return float(static_loss.item())

    out = {}
    for name, step, graphs in (("deepx", dx_step, True), ("compiled", dx_compiled_step, True),
                               ("deepx_nographs", dx_step, False), ("compiled_nographs", dx_compiled_step, False),
                               ("torch", torch_step, False), ("torch_graph", torch_graph_step, False)):
        dx.graphs(graphs)
        try:
            for _ in range(3):
                step()
            out[name] = best(step, steps)
        except Exception as e:  # the compiled rows are extra: their failure must not cost the others
            if name == "deepx" or name == "torch":
                raise
            print(f"  {name} step: FAILED: {type(e).__name__}: {e}", flush=True)
    dx.graphs(True)
    return out


def bench_transformer(dx: Deepx, torch: Any, size: tuple[int, int, int, int], steps: int) -> dict[str, float]:
    """Median ms per warm step of the example's transformer (bench/coldstart.py's trainer), deepx eager and compiled,
    graphs on and off, and torch eager."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from coldstart import load_example, trainer

    def timed(step: Callable[[], None]) -> float:
        for _ in range(5):
            step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    out = {}
    ex = load_example("deepx")
    for name, compiled, graphs in (("deepx", False, True), ("compiled", True, True), ("deepx_nographs", False, False),
                                   ("compiled_nographs", True, False)):
        dx.graphs(graphs)
        try:
            out[name] = timed(trainer(ex, *size, compiled=compiled))
        except Exception as e:
            if name == "deepx":
                raise
            print(f"  {name} step: FAILED: {type(e).__name__}: {e}", flush=True)
    dx.graphs(True)
    tex = load_example("torch")
    torch.set_default_device("cuda")
    try:
        out["torch"] = timed(trainer(tex, *size))
    finally:
        torch.set_default_device("cpu")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (a smoke run)")
    opts = ap.parse_args()
    import torch

    q = opts.quick
    dx = Deepx()
    name = torch.cuda.get_device_name(0)
    rows: list[tuple[str, str, str, str, float, str]] = []  # figure, deepx, torch, unit, ratio, aim
    results: dict[str, Any] = {"device": name, "host": platform.node(), "quick": q}

    def record(key: str, figure: str, r: dict[str, Any], unit: str, higher_is_better: bool, aim: str) -> None:
        ratio = r["deepx"] / r["torch"] if higher_is_better else r["torch"] / r["deepx"]
        results[key] = {**r, "unit": unit, "ratio": ratio}
        rows.append((figure, f"{r['deepx']:.4g}", f"{r['torch']:.4g}", unit, ratio, aim))
        print(f"{figure}: deepx {r['deepx']:.4g} {unit}, torch {r['torch']:.4g} {unit}, ratio {ratio:.2f}x "
              f"(aim {aim})", flush=True)

    steps = [
        ("add", lambda: record("add_256m", "float32 add, 256M elements", bench_add(dx, torch, 1 << (24 if q else 28),
                                                                                   5 if q else 20),
                               "GB/s", True, ">= 0.9x")),
        ("gemm32", lambda: record("gemm_f32", "GEMM 8192, float32", bench_gemm(dx, torch, 2048 if q else 8192,
                                                                            2 if q else 5, False),
                                  "TFLOP/s", True, ">= 0.9x")),
        ("gemm_tf32", lambda: record("gemm_tf32", "GEMM 8192, TF32", bench_gemm(dx, torch, 2048 if q else 8192,
                                                                             2 if q else 20, True),
                                     "TFLOP/s", True, ">= 0.9x")),
        ("chain", lambda: _chain(dx, torch, q, record)),
        ("dispatch", lambda: _dispatch(dx, torch, q, record)),
        ("mlp", lambda: _mlp(dx, torch, q, record)),
        ("transformer", lambda: _transformer(dx, torch, q, record, (32, 64, 2, 16), "example")),
        ("transformer_mid", lambda: _transformer(dx, torch, q, record, (128, 256, 4, 32), "d256x4 ctx128")),
    ]
    for key, step in steps:
        try:
            step()
        except Exception as e:  # one figure failing must not cost the others
            print(f"{key}: FAILED: {type(e).__name__}: {e}", flush=True)
            results[key] = {"error": f"{type(e).__name__}: {e}"}
            rows.append((key, "failed", "", "", float("nan"), str(e)[:80]))
    results["fallbacks"] = dx.fallbacks()
    table = [f"bench/gpu.py on {name} ({'quick' if q else 'full'}); ratio = deepx speed / torch speed",
             "", "| figure | deepx | torch | unit | ratio | aim |", "| --- | ---: | ---: | --- | ---: | --- |"]
    table += [f"| {f} | {a} | {b} | {u} | {r:.2f}x | {aim} |" for f, a, b, u, r, aim in rows]
    if results["fallbacks"]:
        fell = sorted(results["fallbacks"].items())
        table += ["", "ops that ran on the CPU kernel (no CUDA kernel): " +
                  ", ".join(f"{k.removesuffix(' (cpu fallback)')} x{v}" for k, v in fell)]
    text = "\n".join(table)
    print("\n" + text)
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.md").write_text(text + "\n")
    (out / "gpu.json").write_text(json.dumps(results, indent=2, default=str))
    dx.session.close()


def _chain(dx: Deepx, torch: Any, q: bool, record: Callable[..., None]) -> None:
    r = bench_chain(dx, torch, 1 << (22 if q else 28), 3 if q else 10)
    ran = r.pop("ran")
    err = r.pop("max_rel_err")
    print(f"  the chain ran as: {ran}; largest difference from torch, relative to its largest value {err:.2e}",
          flush=True)
    record("chain_fused", f"6-op chain, 256M, fused ({sum(ran.values())} instr)", {k: v * 1e3 for k, v in r.items()},
           "ms", False, ">= 2x")


def _mlp(dx: Deepx, torch: Any, q: bool, record: Callable[..., None]) -> None:
    r = {k: v * 1e3 for k, v in bench_mlp(dx, torch, 5 if q else 30).items()}
    rows = (("deepx", "MLP 784-512-512-10 SGD step, eager", ">= 1.0x"),
            ("compiled", "the same step, dx.compile", ">= 1.0x"),
            ("deepx_nographs", "the same step, eager, cuda_graphs 0", "report"),
            ("compiled_nographs", "the same step, dx.compile, cuda_graphs 0", "report"))
    for key, figure, aim in rows:
        if key in r:
            record(f"mlp_{key}", figure, {"deepx": r[key], "torch": r["torch"]}, "ms", False, aim)
    if "torch_graph" in r:
        for key, figure in (("deepx", "MLP step eager vs torch's CUDA graph"),
                            ("compiled", "MLP step dx.compile vs torch's CUDA graph")):
            if key in r:
                record(f"mlp_{key}_vs_torch_graph", figure, {"deepx": r[key], "torch": r["torch_graph"]}, "ms",
                       False, ">= 0.67x (within 1.5x)")


def _transformer(dx: Deepx, torch: Any, q: bool, record: Callable[..., None], size: tuple[int, int, int, int],
                 label: str) -> None:
    r = {k: v * 1e3 for k, v in bench_transformer(dx, torch, size, 10 if q else 30).items()}
    for key, how, aim in (("deepx", "eager", ">= 1.5x"), ("compiled", "dx.compile", ">= 1.5x"),
                          ("deepx_nographs", "eager, cuda_graphs 0", "report"),
                          ("compiled_nographs", "dx.compile, cuda_graphs 0", "report")):
        if key in r:
            record(f"transformer_{label}_{key}", f"transformer {label} step, {how}", {"deepx": r[key],
                                                                                    "torch": r["torch"]},
                   "ms", False, aim)


def _dispatch(dx: Deepx, torch: Any, q: bool, record: Callable[..., None]) -> None:
    record("dispatch", "tiny-op dispatch, 10,000-instr program", bench_dispatch(dx, torch, 1000 if q else 10_000),
           "us/instr", False, "deepx <= 20 us")


if __name__ == "__main__":
    main()
