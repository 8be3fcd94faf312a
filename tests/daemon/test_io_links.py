"""Links beside a checked path (issue 21, item 1), as an attacker would place them, against a real deepxd over UDP
and the native socket: a save never writes through a link at `P.data.tmp`, a load never reads a secret through a
linked `P.data`, and each is answered with an error naming the op, the tensor and the path."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from deepx_core.ir import parse_text
from tests.daemon.conftest import Daemon, udp_exchange

REPLY_ERR = re.compile(r"^(\d+) error// recv_at=\d+ start_at=\d+ finish_at=\d+ (.+)$", re.DOTALL)
SECRET = b"root:$6$not-for-you$\n" * 4  # 84 bytes: float32[21]
VICTIM = b"a root-only file\n"


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path, Path]]:
    """A daemon whose io root is `root` (its own directory), holding float32 'x', and `outside` beside the root."""
    root = tmp_path_factory.mktemp("io_root")
    outside = tmp_path_factory.mktemp("outside")
    d = Daemon(root).start()
    try:
        with d.client() as c:
            c.put("x", np.arange(21, dtype=np.float32))
        # UDP reaches only tensors made over UDP (or shared with it): 'u' is the UDP scripts' copy of 'x'
        made = udp_exchange(d.udp_port, "newtensor (vector<int32>:[21]) -> (tensor<float32>:u) // id=1\n"
                                        "arange (var<int32>:0, var<int32>:1) -> (tensor<float32>:u) // id=2", 2)
        assert all(" ok//" in r for r in made), made
        yield d, root, outside
    finally:
        assert d.stop() == 0, d.output()


def _refused(d: Daemon, transport: str, line: str, fetch: tuple[str, ...] = ()) -> str:
    """The error `line` is answered with over `transport` (it must fail, and a native run fetch nothing)."""
    if transport == "udp":
        (reply,) = udp_exchange(d.udp_port, line, 1)
        m = REPLY_ERR.match(reply)
        assert m, reply
        return m.group(2)
    with d.client() as c:
        r = c.run(parse_text(line), fetch=list(fetch))
        assert not r.ok and not r.tensors
        return r.error or ""


def _plant_shape(path: Path) -> None:
    path.write_text("dtype: float32\ndim: 1\nshape: [21]\nstride: [1]\nsize: 21\n")


@pytest.mark.parametrize("transport", ["udp", "native"])
def test_a_link_at_the_tmp_file_does_not_make_save_overwrite_a_file_outside(box, transport):
    d, root, outside = box
    victim = outside / f"victim_{transport}"
    victim.write_bytes(VICTIM)
    base = root / f"m_{transport}"
    os.symlink(victim, f"{base}.data.tmp")
    name = "u" if transport == "udp" else "x"
    line = f"save (tensor<float32>:{name}, var<string>:{base}) -> () // id=5"
    error = _refused(d, transport, line)
    assert f"save: cannot write '{name}' to {base}: {base}.data.tmp is a symbolic link" in error, error
    assert victim.read_bytes() == VICTIM
    assert not Path(f"{base}.data").exists() and not Path(f"{base}.shape").exists()
    with d.client() as c:  # the daemon keeps serving
        np.testing.assert_array_equal(c.fetch("x")["x"], np.arange(21, dtype=np.float32))


@pytest.mark.parametrize("transport", ["udp", "native"])
def test_a_linked_data_file_does_not_make_load_read_a_secret(box, transport):
    d, root, outside = box
    secret = outside / f"secret_{transport}"
    secret.write_bytes(SECRET)
    base = root / f"s_{transport}"
    _plant_shape(Path(f"{base}.shape"))
    os.symlink(secret, f"{base}.data")
    line = f"load (var<string>:{base}) -> (tensor<float32>:stolen) // id=6"
    error = _refused(d, transport, line, fetch=("stolen",))
    assert f"load: cannot read 'stolen' from {base}: {base}.data is a symbolic link" in error, error
    with d.client() as c:
        assert "stolen" not in {t["name"] for t in c.admin("tensors")}


def test_a_linked_directory_and_a_linked_shape_file_are_refused_over_udp(box):
    d, root, outside = box
    _plant_shape(outside / "w.shape")
    (outside / "w.data").write_bytes(SECRET)
    os.symlink(outside, root / "linked_dir")
    error = _refused(d, "udp", f"load (var<string>:{root}/linked_dir/w) -> (tensor<float32>:w) // id=7")
    assert "load of 'w': path" in error and "is outside the allowed io roots" in error, error
    (root / "v.data").write_bytes(np.zeros(21, np.float32).tobytes())
    os.symlink(outside / "w.shape", root / "v.shape")
    error = _refused(d, "udp", f"load (var<string>:{root}/v) -> (tensor<float32>:v) // id=8")
    assert f"{root}/v.shape is a symbolic link" in error, error


def test_save_and_load_still_round_trip_over_udp(box):
    d, root, _ = box
    base = root / "sub" / "ok"
    replies = udp_exchange(d.udp_port, f"save (tensor<float32>:u, var<string>:{base}) -> () // id=1\n"
                                       f"load (var<string>:{base}) -> (tensor<float32>:back) // id=2", 2)
    assert all(" ok//" in r for r in replies), replies
    with d.client() as c:
        assert c.fetch("back")["back"].tobytes() == np.arange(21, dtype=np.float32).tobytes()
