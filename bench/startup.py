"""What a command costs before it does anything: `import deepx_sdk`, `deepxctl --help`, `deepxd --help`, and a
`deepxctl tensors ls` against a running deepxd, each in a fresh interpreter, best of N (issue 27, item 2).

Prints seconds per command (aims: `import deepx_sdk` < 0.35 s, a deepxctl listing < 0.5 s) and the bare
interpreter's start for scale; writes bench/results/startup.json. The test suite checks that the heavy modules are
not imported (tests/sdk/test_imports.py, tests/deepxctl/test_cli.py); this times it.

    python bench/startup.py [--repeat N]

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


def best(args: list[str], repeat: int, env: dict[str, str]) -> float:
    out = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(args, check=True, capture_output=True, env=env, cwd=ROOT)
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="deepx-bench-") as tmp:
        sock = f"unix://{tmp}/d.sock"
        daemon = subprocess.Popen([py, "-m", "deepxd", "start", "--listen", sock, "--udp", "off", "--kv",
                                   "memory"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
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
                "deepxd --help": [py, "-m", "deepxd", "--help"],
            }
            result = {name: best(cmd, args.repeat, env) for name, cmd in cases.items()}
        finally:
            daemon.terminate()
            daemon.wait(30)
    for name, seconds in result.items():
        print(f"{seconds:7.3f} s  {name}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
