"""examples/train_ddp.py: one command starts a redis-server, a deepxd per rank and the ranks, trains the MLP with
DistributedDataParallel and stops everything it started."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"


def test_train_ddp_on_two_ranks_each_with_its_deepxd(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(EXAMPLE), "--ranks", "2", "--epochs", "5", "--daemons", "per-rank"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "2 ranks, one deepxd each on a redis-server" in p.stdout
    m = re.search(r"test accuracy (\d\.\d+) after 5 epochs on 2 ranks", p.stdout)
    assert m, p.stdout
    assert float(m.group(1)) >= 0.9
    assert (tmp_path / "mlp_digits_ddp.safetensors").stat().st_size > 40_000
