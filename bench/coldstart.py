"""Cold start on the GPU: the character transformer of examples/train_transformer.py, its first step and its first N
steps in a fresh process on an empty kernel cache, deepx (nvcc, NVRTC, NVRTC with the background warm-up, and NVRTC
again on the cache that run filled) against torch eager on the same GPU (issue 25, item 4; aim: first step under 3 s).

    python bench/coldstart.py [--steps 200] [--quick]

Each row is one fresh interpreter (`--child MODE`), timed from before `import deepx_sdk` / `import torch`; deepx
rows run an embedded daemon with op-cuda (`dx.connect(roles=["heapmem", "op-cuda"])`) and their own empty
`DEEPX_CUDA_CACHE`. Writes bench/results/coldstart.json ($OUT/coldstart.json when OUT is set).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402  (the clock starts before any import)
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_transformer.py"

#: mode -> (framework, environment for the child)
MODES: dict[str, tuple[str, dict[str, str]]] = {
    "deepx nvcc": ("deepx", {"DEEPX_CUDA_COMPILER": "nvcc", "DEEPX_CUDA_WARM": "0"}),
    "deepx nvrtc": ("deepx", {"DEEPX_CUDA_COMPILER": "nvrtc", "DEEPX_CUDA_WARM": "0"}),
    "deepx nvrtc + warm": ("deepx", {"DEEPX_CUDA_COMPILER": "nvrtc", "DEEPX_CUDA_WARM": "1"}),
    "deepx, cache after a warm run": ("deepx", {"DEEPX_CUDA_COMPILER": "nvrtc", "DEEPX_CUDA_WARM": "1"}),
    "torch eager": ("torch", {}),
}


def load_example(framework: str) -> dict[str, Any]:
    """The example's module namespace, with torch in place of deepx when `framework` is "torch" (the model is
    written as PyTorch code, so the same classes build either)."""
    src = EXAMPLE.read_text()
    if framework == "torch":
        src = (src.replace("import deepx_sdk as dx", "import torch as dx")
               .replace("import deepx_sdk.nn as nn", "import torch.nn as nn")
               .replace("import deepx_sdk.nn.functional as F", "import torch.nn.functional as F")
               .replace("from deepx_sdk.optim import AdamW, CosineAnnealingLR",
                        "from torch.optim import AdamW\nfrom torch.optim.lr_scheduler import CosineAnnealingLR"))
    sys.path.insert(0, str(EXAMPLE.parent))
    ns: dict[str, Any] = {"__name__": "train_transformer_" + framework, "__file__": str(EXAMPLE)}
    exec(compile(src, str(EXAMPLE), "exec"), ns)  # our own example file, with its imports swapped
    return ns


def trainer(ex: dict[str, Any], context: int = 32, d_model: int = 64, layers: int = 2, batch: int = 16,
            compiled: bool = False, **adamw: Any) -> Callable[[], None]:
    """One training step of the example's model, as its script takes one (a random batch of windows, AdamW at lr
    4e-3 and `adamw`), on the framework `ex` was loaded for (load_example); `compiled`: the step under dx.compile."""
    import numpy as np

    dx, F = ex["dx"], ex["F"]
    dx.manual_seed(0)
    text = ex["DATA"].read_text(encoding="utf-8")
    tok = ex["CharTokenizer"](text)
    data = tok.encode(text)
    model = ex["CharTransformer"](len(tok), context, d_model, 4, layers)
    opt = ex["AdamW"](model.parameters(), lr=4e-3, **adamw)
    rng = np.random.default_rng(0)

    def core(x: Any, y: Any) -> Any:
        opt.zero_grad()
        loss = F.cross_entropy(model(x).view(-1, len(tok)), y.view(-1))
        loss.backward()
        opt.step()
        return loss

    run = dx.compile(core) if compiled else core

    def step() -> None:
        starts = rng.integers(0, len(data) - context - 1, batch)
        window = np.stack([data[s:s + context + 1] for s in starts])
        run(dx.tensor(window[:, :-1]), dx.tensor(window[:, 1:])).item()

    return step


def child(framework: str, steps: int) -> dict[str, float]:
    ex = load_example(framework)
    dx = ex["dx"]
    if framework == "deepx":
        dx.connect(roles=["heapmem", "op-cuda"])
    else:
        dx.set_default_device("cuda")  # the example's tensors and the model's parameters, as deepx places them
        dx.zeros(1)  # the context, as deepx's connect makes it
    t_ready = time.perf_counter()
    step = trainer(ex, betas=(0.9, 0.99), weight_decay=0.01)
    marks = []
    for _ in range(steps):
        step()
        marks.append(time.perf_counter())
    return {"ready_s": t_ready - T_START, "first_step_s": marks[0] - T_START, "steps_s": marks[-1] - T_START,
            "warm_step_ms": 1e3 * (marks[-1] - marks[len(marks) // 2]) / max(1, len(marks) - 1 - len(marks) // 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="20 steps")
    ap.add_argument("--child", choices=["deepx", "torch"], help=argparse.SUPPRESS)
    opts = ap.parse_args()
    steps = 20 if opts.quick else opts.steps
    if opts.child:
        print(json.dumps(child(opts.child, steps)))
        return
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, (framework, env) in MODES.items():
            cache = Path(tmp) / ("shared" if "warm" in mode else mode.replace(" ", "-").replace(",", ""))
            path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
            full = {**os.environ, **env, "DEEPX_CUDA_CACHE": str(cache), "PYTHONPATH": path}
            out = subprocess.run([sys.executable, __file__, "--child", framework, "--steps", str(steps)],
                                 env=full, capture_output=True, text=True, cwd=ROOT)
            if out.returncode:
                print(f"{mode}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
                continue
            rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    torch_row = rows.get("torch eager")
    print(f"{'mode':24} {'ready s':>8} {'first step s':>13} {f'{steps} steps s':>12} {'warm step ms':>13} "
          f"{'first / torch':>14}")
    for mode, r in rows.items():
        ratio = f"{r['first_step_s'] / torch_row['first_step_s']:.2f}x" if torch_row else "-"
        print(f"{mode:24} {r['ready_s']:8.2f} {r['first_step_s']:13.2f} {r['steps_s']:12.2f} "
              f"{r['warm_step_ms']:13.2f} {ratio:>14}")
    dest = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "coldstart.json").write_text(json.dumps({"steps": steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
