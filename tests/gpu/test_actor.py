"""op-cuda in a real deepxd started as the issue writes it (`deepxd start --role=heapmem,op-cuda`): the same SDK code
gives the same numbers as op-cpu, tensors live on the GPU, bad programs and out-of-memory give clear errors and the
daemon keeps serving, and an op without a CUDA kernel runs on the CPU kernel, counted in the op stats (and shown by
deepxctl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("pycuda.driver", reason="PyCUDA is not installed: the op-cuda tests need an NVIDIA GPU "
                    "(pip install -e '.[cuda]' there: docs/cuda.md)")
from deepxd.config import cuda_available

if not cuda_available():
    pytest.skip("no CUDA device answers here: the op-cuda tests need an NVIDIA GPU", allow_module_level=True)

import deepx_sdk as dx
import deepx_sdk.nn.functional as F
from deepx_core.ir import parse_text
from deepxd.kernels.cpu import CpuExecutor
from tests.daemon.conftest import Daemon

TEN_TB = 1_000_000 * 2_500_000 * 4


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("opcuda")
    d = Daemon(tmp, kv=f"memory://{tmp}/plane.aof", extra=["--role", "heapmem,op-cuda"], udp=False)
    d.start(wait=False)
    d.wait_ready(120)
    yield d
    rc = d.stop()
    assert rc == 0, d.output()


@pytest.fixture
def client(gpu):
    with gpu.client() as c:
        yield c


def test_heapmem_op_cuda_runs_with_the_roles_that_reach_it(client):
    assert set(client.server["roles"]) == {"heapmem", "op-cuda", "registry", "scheduler"}
    (node,) = [n for n in client.admin("nodes") if n["state"] == "running"]
    assert "op-cuda" in node["roles"]
    assert node["devices"] == "cuda:0"  # where its op worker computes (no op-cpu here)


def _sdk_program() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    x = dx.tensor(rng.standard_normal((64, 48)).astype(np.float32))
    w = dx.tensor(rng.standard_normal((48, 32)).astype(np.float32))
    b = dx.tensor(rng.standard_normal(32).astype(np.float32))
    y = x @ w + b
    z = ((y * 0.5 + 1.0).relu() - (y * 0.1).exp()).abs()
    return {"matmul": y.numpy(), "chain": z.numpy(), "sum": y.sum(dim=1).numpy(), "mean": z.mean().numpy(),
            "softmax": F.softmax(y, dim=-1).numpy(), "t": (y.t() @ y).numpy()}


def test_the_same_sdk_code_gives_the_same_numbers_as_op_cpu(gpu, monkeypatch):
    monkeypatch.delenv("DEEPX_ROLES", raising=False)
    try:
        dx.connect(gpu.address)
        on_gpu = _sdk_program()
        dx.connect()  # the embedded daemon, on op-cpu
        on_cpu = _sdk_program()
    finally:
        dx.disconnect()
    for k in on_cpu:
        np.testing.assert_allclose(on_gpu[k], on_cpu[k], rtol=2e-4, atol=2e-4, err_msg=k)


def test_tensors_live_on_the_gpu_heap_tensors_with_an_ipc_handle(client):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert client.put("ga", a)["device"] == "cuda:0"
    info = client.put("gw", a * 2, heap=True)
    assert (info["kind"], info["device"]) == ("heap", "cuda:0")
    r = client.run(parse_text("add (tensor:ga, tensor:gw) -> (tensor:gs)"), fetch=["gs", "gw"]).raise_for_error()
    np.testing.assert_array_equal(r.tensors["gs"], a * 3)
    np.testing.assert_array_equal(client.fetch("gw")["gw"], a * 2)
    rows = {r["name"]: r for r in client.admin("tensors")}
    assert rows["ga"]["device"] == rows["gs"]["device"] == "cuda:0"
    assert rows["gw"]["device"] == "cuda:0" and rows["gw"]["kind"] == "heap"
    assert len(rows["gw"]["ipc_handle"]) == 128 and int(rows["gw"]["refcount"]) == 1
    for name in ("ga", "gs", "gw"):
        client.request("delete", name=name)
    assert not {"ga", "gs", "gw"} & {r["name"] for r in client.admin("tensors")}


def test_a_bad_program_is_refused_whole_and_the_daemon_keeps_serving(client):
    client.put("b1", np.ones((2, 3), np.float32))
    client.put("b2", np.ones((4, 5), np.float32))
    r = client.run(parse_text("mulscalar (tensor:b1, var:2.0) -> (tensor:b3)\n"
                              "matmul (tensor:b1, tensor:b2) -> (tensor:b4)"))
    assert not r.ok and r.done == 0 and r.error_index == 1
    assert "instruction 2: matmul" in r.error and "(2, 3)" in r.error.replace("[", "(").replace("]", ")")
    assert "b3" not in {t["name"] for t in client.admin("tensors")}  # nothing ran
    r = client.run(parse_text("mulscalar (tensor:b1, var:2.0) -> (tensor:b3)"), fetch=["b3"]).raise_for_error()
    np.testing.assert_array_equal(r.tensors["b3"], np.full((2, 3), 2, np.float32))


@pytest.mark.parametrize("kind", ["stack", "heap"])
def test_out_of_memory_names_the_tensor_and_the_bytes_and_the_daemon_keeps_serving(client, kind):
    meta = " // kind=heap" if kind == "heap" else ""
    name = f"big_{kind}"
    r = client.run(parse_text(f"newtensor (vector<int32>:[2 2]) -> (tensor<float32>:small_{kind})\n"
                              f"newtensor (vector<int32>:[1000000 2500000]) -> (tensor<float32>:{name}){meta}"))
    assert not r.ok and r.error_index == 1, r.error
    assert "out of" in r.error and "memory" in r.error
    assert f"'{name}'" in r.error and str(TEN_TB) in r.error, r.error
    names = {t["name"] for t in client.admin("tensors")}
    assert name not in names and f"small_{kind}" in names  # the instruction before it ran
    r = client.run(parse_text(f"addscalar (tensor:small_{kind}, var:1.5) -> (tensor:small_{kind})"),
                   fetch=[f"small_{kind}"]).raise_for_error()
    np.testing.assert_array_equal(r.tensors[f"small_{kind}"], np.full((2, 2), 1.5, np.float32))
    mem = client.admin("memory")["heapmem"]
    assert mem["device"] == "cuda:0" and mem["tensors"] == sum(
        t["kind"] == "heap" for t in client.admin("tensors"))


# a reduction over every other dim of an 18-d tensor: its kept and reduced dims do not collapse into the at most 8
# dims the CUDA reduce kernel takes, so the executor runs the CPU kernel on host copies
FALLBACK = "sum (tensor:fr, vector<int32>:[0 2 4 6 8 10 12 14 16], var<bool>:false) -> (tensor:fs)"


def _sum_calls(client) -> dict[str, int]:
    return {o["op"]: o["calls"] for o in client.admin("ops") if o["worker"] == "op-cuda" and o["op"].startswith("sum")}


def test_an_op_without_a_cuda_kernel_runs_on_the_cpu_kernel_counted_in_the_op_stats(gpu, client):
    key = "sum (cpu fallback)"
    time.sleep(0.5)  # earlier programs' counters reach the plane (heartbeat 0.2 s here)
    before = _sum_calls(client)
    x = (np.arange(2**18, dtype=np.float32) % 7).reshape([2] * 18)
    client.put("fr", x)
    r = client.run(parse_text(FALLBACK), fetch=["fs"]).raise_for_error()
    ex = CpuExecutor()
    ex.put("fr", x)
    ex.run_all(parse_text(FALLBACK))
    np.testing.assert_array_equal(r.tensors["fs"], ex.get("fs"))
    deadline = time.monotonic() + 15
    now = before
    while time.monotonic() < deadline and now == before:
        time.sleep(0.1)
        now = _sum_calls(client)
    if now.get("sum", 0) > before.get("sum", 0):
        pytest.skip("the CUDA reduce kernel now takes this reduction: nothing falls back")
    assert now.get(key, 0) == before.get(key, 0) + 1, f"no new {key!r} call in {now} (before: {before})"
    out = subprocess.run([sys.executable, "-m", "deepxctl", "--address", gpu.address, "ops", "ls", "--format",
                          "json", "--filter", "worker=op-cuda"], capture_output=True, text=True, timeout=60,
                         env={**os.environ})
    assert out.returncode == 0, out.stderr
    assert key in {row["op"] for row in json.loads(out.stdout)}, out.stdout
