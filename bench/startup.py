"""What a command costs before it does anything: `import deepx_sdk`, `deepxctl --help`, `deepxd --help`, and a
`deepxctl tensors ls` against a running deepxd, each in a fresh interpreter, best of N (issue 27, item 2).

Prints seconds per command (aims: `import deepx_sdk` < 0.35 s, a deepxctl listing < 0.5 s) and the bare
interpreter's start for scale; writes bench/results/startup.json. The test suite checks that the heavy modules are
not imported (tests/sdk/test_imports.py, tests/deepxctl/test_cli.py); this times it.

    python bench/startup.py [--repeat N] [--tree PATH]

`--tree` times another checkout of deepx (a baseline) with this script; the two runs go in turn, command by command,
so that a busy machine weighs on both alike.

`python -X importtime -c "import deepx_sdk" 2>&1 | sort -t'|' -k2 -n | tail` shows where an import's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def once(args: list[str], env: dict[str, str], cwd: Path) -> float:
    """Seconds `args` took, run in `cwd` (which `python -c` puts first on sys.path)."""
    t0 = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True, env=env, cwd=cwd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--tree", type=Path, help="also time this checkout (a baseline), command by command in turn")
    args = ap.parse_args()
    trees = [ROOT] + ([args.tree.resolve()] if args.tree else [])
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="deepx-bench-") as tmp:
        sock = f"unix://{tmp}/d.sock"
        daemon = subprocess.Popen([py, "-m", "deepxd.cli", "start", "--listen", sock, "--udp", "off", "--kv",
                                   "memory"], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not Path(tmp, "d.sock").exists():
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise SystemExit("deepxd did not start")
                time.sleep(0.05)
            cases = {
                "python -c pass": [py, "-c", "pass"],
                "import deepx_sdk": [py, "-c", "import deepx_sdk"],
                "import deepx_sdk as dx; dx.randn(2)": [py, "-c", "import deepx_sdk as dx; dx.randn(2)"],
                "deepxctl --help": [py, "-m", "deepxctl", "--help"],
                "deepxctl tensors ls": [py, "-m", "deepxctl", "--address", sock, "tensors", "ls"],
                "deepxctl tensors ls --format json": [py, "-m", "deepxctl", "--address", sock, "tensors", "ls",
                                                      "--format", "json"],
                "deepxd --help": [py, "-m", "deepxd.cli", "--help"],
            }
            result: dict[str, dict[str, float]] = {str(tree): {} for tree in trees}
            for name, cmd in cases.items():
                for _ in range(args.repeat):
                    for tree in trees:
                        env = {**os.environ, "PYTHONPATH": str(tree)}
                        seconds = once(cmd, env, tree)
                        was = result[str(tree)].get(name, float("inf"))
                        result[str(tree)][name] = min(was, seconds)
        finally:
            daemon.terminate()
            daemon.wait(30)
    print("   ".join(f"{str(tree)[-24:]:>24}" for tree in trees))
    for name in cases:
        print("   ".join(f"{result[str(tree)][name]:22.3f} s" for tree in trees) + f"   {name}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
