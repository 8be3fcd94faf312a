"""The heap pool's default follows /dev/shm's size (issue 27, item 7): Docker's 64 MB /dev/shm must not be filled by
freed segments kept for reuse."""

from __future__ import annotations

import json
import os
from pathlib import Path

from click.testing import CliRunner

from deepxctl.cli import cli
from deepxd.config import HEAP_POOL_MAX, heap_pool_default, load_config
from tests.daemon.conftest import Daemon


def shm_size() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_blocks * st.f_frsize


def test_a_quarter_of_dev_shm_at_most_256_mib() -> None:
    assert heap_pool_default(64_000_000) == 16_000_000  # docker run's default --shm-size
    assert heap_pool_default(1 << 30) == HEAP_POOL_MAX == 256 << 20
    assert heap_pool_default(64 << 30) == HEAP_POOL_MAX
    assert heap_pool_default(None) == HEAP_POOL_MAX  # no /dev/shm, or a tmpfs without a size


def test_the_default_is_computed_and_a_setting_wins() -> None:
    assert load_config(env={}).heap_pool_bytes == -1
    assert load_config(env={}).resolved().heap_pool_bytes == min(HEAP_POOL_MAX, shm_size() // 4)
    assert load_config(env={"DEEPX_HEAP_POOL_BYTES": "4096"}).resolved().heap_pool_bytes == 4096
    assert load_config(env={"DEEPX_HEAP_POOL_BYTES": "0"}).resolved().heap_pool_bytes == 0  # no pool


def test_a_daemon_reports_the_pool_it_was_given(tmp_path: Path) -> None:
    d = Daemon(tmp_path, udp=False).start()
    try:
        r = CliRunner().invoke(cli, ["--address", d.address, "memory", "--format", "json"], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["heapmem"]["pool_limit"] == min(HEAP_POOL_MAX, shm_size() // 4)
    finally:
        assert d.stop() == 0, d.output()
