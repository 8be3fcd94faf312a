"""The README's main job: examples/train_mlp.py trains an MLP on the bundled digits through the embedded daemon."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"


def test_train_mlp_reaches_95_percent(tmp_path):
    p = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"test accuracy (\d\.\d+)", p.stdout)
    assert m, p.stdout
    assert float(m.group(1)) >= 0.95
    assert (tmp_path / "mlp_digits.safetensors").stat().st_size > 40_000
