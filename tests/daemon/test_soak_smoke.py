"""bench/soak.py for a few seconds: its own redis-server and deepxd come up, every kind of input is tried, a Redis
restart happens, and the run ends with its table and exit code 0."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="the soak starts a real redis-server")
def test_a_short_soak_passes() -> None:
    out = subprocess.run([sys.executable, str(SOAK), "--minutes", "0.08", "--clients", "4", "--kill-every", "2",
                          "--seed", "1"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    table = out.stdout
    assert "passed: no crash, wrong result or data lost" in table
    for row in ("inputs tried", "crashes", "hangs", "wrong results", "data lost", "worst ping"):
        assert row in table, table
    assert " 0 UDP lines" not in table and " 0 native frames" not in table and " 0 client ops" not in table
    assert "1 Redis restarts" in table, table
