"""Two daemons on one machine meet on the defaults: the one that cannot start says how to start anyway (issue 27,
item 4), and `--udp HOST:0` takes a free port that the log and `nodes ls` name."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.daemon.conftest import DEEPXCTL, DEEPXD, Daemon


def test_a_taken_udp_port_names_the_ways_out(tmp_path: Path) -> None:
    first = Daemon(tmp_path).start()
    try:
        second = subprocess.run([*DEEPXD, "start", "--listen", f"unix://{tmp_path}/b.sock", "--kv", "memory",
                                 "--udp", f"127.0.0.1:{first.udp_port}"], capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        last = second.stderr.strip().splitlines()[-1]
        assert f"cannot listen on udp://127.0.0.1:{first.udp_port}: the port is in use" in last
        assert "--udp off" in last and "--udp 127.0.0.1:0" in last
    finally:
        assert first.stop() == 0, first.output()


def test_udp_port_0_takes_a_free_port_and_says_which(tmp_path: Path) -> None:
    d = Daemon(tmp_path, extra=["--udp", "127.0.0.1:0"], udp=False).start()
    try:
        rows = json.loads(subprocess.run([*DEEPXCTL, "--address", d.address, "nodes", "ls", "--format", "json"],
                                         capture_output=True, text=True, timeout=120, check=True).stdout)
        (udp,) = [a for a in rows[0]["addresses"].values() if a.startswith("127.0.0.1:")] or [None]
        assert udp is not None and not udp.endswith(":0"), rows
    finally:
        assert d.stop() == 0, d.output()
    assert f"udp://{udp}" in d.output()
