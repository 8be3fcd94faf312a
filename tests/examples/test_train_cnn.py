"""examples/train_cnn.py: a small CNN (convolution, batch norm, pooling) trained on the bundled digits through the
embedded daemon with the data utilities; four epochs here (the README quotes the full run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_cnn.py"


def test_train_cnn_learns_the_digits(tmp_path):
    p = subprocess.run([sys.executable, str(EXAMPLE), "--epochs", "4"], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    losses = [float(v) for v in re.findall(r"epoch \d+: loss (\d+\.\d+)", p.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] * 0.5, p.stdout
    m = re.search(r"test accuracy (\d\.\d+)", p.stdout)
    assert m, p.stdout
    assert float(m.group(1)) >= 0.8
