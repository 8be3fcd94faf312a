"""The packages' layers point one way: the import contracts of pyproject.toml ([tool.importlinter]) hold."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    exe = shutil.which("lint-imports")
    assert exe, "lint-imports (import-linter, a dev dependency) is not installed: pip install -e '.[dev]'"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_importing_the_daemon_leaves_the_sdk_unimported():
    code = "import sys, deepxd.node, deepxd.cli; print(sorted(m for m in sys.modules if m.startswith('deepx_sdk')))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
