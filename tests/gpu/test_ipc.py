"""GPU heap tensors shared between processes through CUDA IPC handles: a daemon with op-cuda puts heap tensors in GPU
memory with the handle in their `tensor:<name>` record; a second process (a real subprocess) opens the handle with
deepxd.ipc, sees the daemon's values, and a change it makes is seen by the daemon; refcount zero frees the memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pycuda.driver", reason="PyCUDA is not installed: the CUDA IPC tests need an NVIDIA GPU "
                    "(pip install -e '.[cuda]' there: docs/cuda.md)")
from deepxd.config import cuda_available

if not cuda_available():
    pytest.skip("no CUDA device answers here: the CUDA IPC tests need an NVIDIA GPU", allow_module_level=True)

from deepx_core.ir import parse_text
from deepxd.ipc import read_record
from tests.daemon.conftest import Daemon

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
SLACK = 64 << 20  # what else the driver may take or give back meanwhile

OPENER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from deepxd.ipc import open_tensor

    url, name, expected = sys.argv[1], sys.argv[2], sys.argv[3]
    with open_tensor(url, name) as t:
        seen = t.get()
        ok = expected == "-" or bool(np.array_equal(seen, np.load(expected)))
        if expected != "-":
            t.set(seen * 2 + 1)              # a change the daemon must see
        print(json.dumps({"ok": ok, "shape": list(t.shape), "dtype": str(t.dtype), "device": t.device,
                          "sum": float(seen.sum())}))
""")


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ipc")
    d = Daemon(tmp, kv=f"memory://{tmp}/plane.aof", extra=["--role", "registry,heapmem,scheduler,op-cuda"],
               udp=False)
    d.start(wait=False)
    d.wait_ready(120)
    yield d
    rc = d.stop()
    assert rc == 0, d.output()


def _open_in_another_process(d: Daemon, name: str, expected: np.ndarray | None) -> dict:
    """Run OPENER in a new process: it compares with `expected` and writes 2x+1 (None: it only reads)."""
    path = d.tmp / f"{name}.npy"
    if expected is not None:
        np.save(path, expected)
    arg = "-" if expected is None else str(path)
    out = subprocess.run([sys.executable, "-c", OPENER, d.kv, name, arg], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_another_process_reads_and_writes_a_heap_tensor_through_its_ipc_handle(gpu):
    with gpu.client() as c:
        w = np.random.default_rng(0).standard_normal((256, 384)).astype(np.float32)
        c.put("shared_w", w, heap=True)
        f = read_record(gpu.kv, "shared_w")
        assert f["device"] == "cuda:0" and f["kind"] == "heap" and f["refcount"] == "1"
        assert int(f["bytes"]) == w.nbytes and len(bytes.fromhex(f["ipc_handle"])) == 64
        seen = _open_in_another_process(gpu, "shared_w", w)
        assert seen["ok"] and seen["shape"] == [256, 384] and seen["dtype"] == "float32"
        assert seen["device"] == "cuda:0"
        np.testing.assert_array_equal(c.fetch("shared_w")["shared_w"], w * 2 + 1)  # the daemon sees the change
        # and the daemon's programs read it: a change of the daemon's is seen by the other process in turn
        r = c.run(parse_text("mulscalar (tensor:shared_w, var:0.5) -> (tensor:shared_w)"),
                  fetch=["shared_w"]).raise_for_error()
        np.testing.assert_allclose(r.tensors["shared_w"], (w * 2 + 1) * 0.5, rtol=1e-6)
        again = _open_in_another_process(gpu, "shared_w", r.tensors["shared_w"])
        assert again["ok"]
        c.request("delete", name="shared_w")


def test_a_heap_tensor_made_by_a_program_is_on_the_gpu_and_refcount_zero_frees_it(gpu):
    import pycuda.driver as drv

    drv.init()
    ctx = drv.Device(0).retain_primary_context()
    ctx.push()
    try:
        with gpu.client() as c:
            free0, _ = drv.mem_get_info()
            c.run(parse_text("newtensor (vector<int32>:[268435456]) -> (tensor<float32>:big_heap) // kind=heap")
                  ).raise_for_error()
            f = read_record(gpu.kv, "big_heap")
            assert f["device"] == "cuda:0" and int(f["bytes"]) == GIB and f["refcount"] == "1"
            free1, _ = drv.mem_get_info()
            assert free0 - free1 >= GIB - SLACK, (free0, free1)
            seen = _open_in_another_process(gpu, "big_heap", None)
            assert seen["ok"] and seen["shape"] == [268435456] and seen["sum"] == 0.0  # zero-filled
            c.run(parse_text("deltensor () -> (tensor:big_heap)")).raise_for_error()  # the last reference
            assert read_record(gpu.kv, "big_heap") == {}
            deadline = time.monotonic() + 10
            free2, _ = drv.mem_get_info()
            while free2 - free1 < GIB - SLACK and time.monotonic() < deadline:  # freed on the worker's thread
                time.sleep(0.05)
                free2, _ = drv.mem_get_info()
            assert free2 - free1 >= GIB - SLACK, (free1, free2)
            assert c.admin("memory")["heapmem"]["tensors"] == 0
    finally:
        drv.Context.pop()
        ctx.detach()


def test_opening_a_freed_or_unknown_tensor_is_a_clear_error(gpu):
    out = subprocess.run([sys.executable, "-c", "import sys\nfrom deepxd.ipc import open_tensor\n"
                          "open_tensor(sys.argv[1], 'never_made')", gpu.kv], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode != 0 and "no tensor:never_made in the storage plane" in out.stderr


def test_gpu_heap_tensors_do_not_outlive_their_daemon(tmp_path):
    d = Daemon(tmp_path, kv=f"memory://{tmp_path}/plane.aof", extra=["--role", "heapmem,op-cuda"], udp=False)
    d.start(wait=False)
    d.wait_ready(120)
    with d.client() as c:
        c.put("kept_w", np.ones((4, 4), np.float32), heap=True)
    assert d.stop() == 0, d.output()
    assert read_record(d.kv, "kept_w")["state"] == "stopped"
    again = Daemon(tmp_path, kv=d.kv, node_id=d.node_id, extra=["--role", "heapmem,op-cuda"], udp=False)
    again.start(wait=False)
    again.wait_ready(120)
    try:
        f = read_record(d.kv, "kept_w")
        assert f["state"] == "lost" and f["device"] == "cuda:0"
        with again.client() as c:
            r = c.run(parse_text("addscalar (tensor:kept_w, var:1.0) -> (tensor:kept_w)"))
            assert not r.ok and "kept_w" in r.error
    finally:
        assert again.stop() == 0, again.output()
