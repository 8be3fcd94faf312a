"""Issue 21 on op-cuda: newtensor replaces a tensor of another shape or dtype and keeps one of the same, and save/load
never go through a link beside the checked path, as on op-cpu (tests/kernels/test_io_links.py,
tests/kernels/test_newtensor_replace.py)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pycuda.driver", reason="PyCUDA is not installed: the op-cuda tests need an NVIDIA GPU "
                    "(pip install -e '.[cuda]' there: docs/cuda.md)")
from deepxd.config import cuda_available

if not cuda_available():
    pytest.skip("no CUDA device answers here: the op-cuda tests need an NVIDIA GPU", allow_module_level=True)

from deepx_core.ir import parse_text
from tests.daemon.conftest import Daemon


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("opcuda-hardening")
    d = Daemon(tmp, extra=["--role", "heapmem,op-cuda"], udp=False)
    d.start(wait=False)
    d.wait_ready(120)
    yield d
    assert d.stop() == 0, d.output()


def test_newtensor_keeps_the_same_and_replaces_another_shape_on_the_gpu(gpu: Daemon) -> None:
    with gpu.client() as c:
        r = c.run(parse_text("newtensor (vector<int32>:[2 3]) -> (tensor<float32>:nt_a)\n"
                             "constant (var<float32>:2.5) -> (tensor<float32>:nt_a)\n"
                             "newtensor (vector<int32>:[2 3]) -> (tensor<float32>:nt_a)"), fetch=["nt_a"])
        assert r.ok, r.error
        np.testing.assert_array_equal(r.tensors["nt_a"], np.full((2, 3), 2.5, np.float32))  # kept, values and all
        r = c.run(parse_text("newtensor (vector<int32>:[5]) -> (tensor<int64>:nt_a)\n"
                             "addscalar (tensor<int64>:nt_a, var<int64>:7) -> (tensor<int64>:nt_a)"), fetch=["nt_a"])
        assert r.ok, r.error
        assert r.tensors["nt_a"].dtype == np.int64
        np.testing.assert_array_equal(r.tensors["nt_a"], np.full(5, 7, np.int64))


def test_save_and_load_refuse_links_on_the_gpu(gpu: Daemon) -> None:
    outside = gpu.tmp.parent / "outside-secret"
    outside.write_bytes(b"root only")
    base = gpu.tmp / "gsave"
    (gpu.tmp / "gsave.data.tmp").symlink_to(outside)
    with gpu.client() as c:
        c.put("gs_x", np.arange(6, dtype=np.float32).reshape(2, 3))
        r = c.run(parse_text(f"save (tensor:gs_x, var<string>:{base}) -> ()"))
        assert not r.ok and "symbolic link" in (r.error or ""), r.error
        assert outside.read_bytes() == b"root only"
        (gpu.tmp / "gsave.data.tmp").unlink()
        assert c.run(parse_text(f"save (tensor:gs_x, var<string>:{base}) -> ()")).ok
        r = c.run(parse_text(f"load (var<string>:{base}) -> (tensor<float32>:gs_y)"), fetch=["gs_y"])
        assert r.ok, r.error
        np.testing.assert_array_equal(r.tensors["gs_y"], np.arange(6, dtype=np.float32).reshape(2, 3))
        (gpu.tmp / "gleak.shape").write_text((gpu.tmp / "gsave.shape").read_text())
        (gpu.tmp / "gleak.data").symlink_to(gpu.tmp / "gsave.data")
        r = c.run(parse_text(f"load (var<string>:{gpu.tmp / 'gleak'}) -> (tensor<float32>:gs_z)"))
        assert not r.ok and "symbolic link" in (r.error or ""), r.error
