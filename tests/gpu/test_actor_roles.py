"""op-cuda's roles, placement and the IPC record reader: what holds on any machine, GPU or not (the GPU itself is
exercised by the other files in tests/gpu, which skip without one)."""

from __future__ import annotations

import pytest

import deepx_sdk as dx
from deepx_core.errors import DeepxError
from deepxd.actors.base import Actor
from deepxd.actors.scheduler import Scheduler
from deepxd.config import cuda_available, default_roles, load_config, with_needed_roles
from deepxd.ipc import open_tensor, read_record
from deepxd.kv.base import open_kv
from tests.daemon.conftest import Daemon


def test_a_worker_role_brings_the_roles_that_reach_it():
    assert with_needed_roles(["heapmem", "op-cuda"]) == ["heapmem", "op-cuda", "registry", "scheduler"]
    full = ["registry", "heapmem", "scheduler", "op-cuda"]
    assert with_needed_roles(full) == full
    assert with_needed_roles(["heapmem"]) == ["heapmem"]  # no worker: nothing to reach
    assert load_config(None, env={}, roles="heapmem,op-cuda").resolved().roles == [
        "heapmem", "op-cuda", "registry", "scheduler"]
    assert load_config(None, env={"DEEPX_CUDA_DEVICE": "1"}).cuda_device == 1
    with pytest.raises(DeepxError, match="cuda_device: -2 is not a GPU's ordinal"):
        load_config(None, env={}, cuda_device=-2).resolved()


def test_cuda_devices_name_the_gpus_of_op_cuda_one_worker_each():
    """Empty: every visible GPU (cuda_device where set, as before); else those named, checked."""
    assert load_config(None, env={}).resolved().cuda_devices == []
    assert load_config(None, env={"DEEPX_CUDA_DEVICE": "1"}).resolved().cuda_devices == ["1"]
    assert load_config(None, env={"DEEPX_CUDA_DEVICES": "0,cuda:2"}).resolved().cuda_devices == ["0", "2"]
    with pytest.raises(DeepxError, match="cuda_devices: 'gpu1' is not a GPU's ordinal"):
        load_config(None, env={"DEEPX_CUDA_DEVICES": "gpu1"}).resolved()
    with pytest.raises(DeepxError, match="cuda_devices: GPU 1 is named twice"):
        load_config(None, env={}, cuda_devices=["1", "cuda:1"]).resolved()


def test_default_roles_name_op_cuda_only_where_a_gpu_answers():
    assert ("op-cuda" in default_roles()) == cuda_available()
    assert default_roles()[:4] == ["registry", "heapmem", "scheduler", "op-cpu"]


def test_op_cuda_without_a_gpu_stops_start_up_with_one_line(tmp_path):
    if cuda_available():
        pytest.skip("a GPU answers here: op-cuda starts (tests/gpu/test_actor.py)")
    d = Daemon(tmp_path, extra=["--role", "heapmem,op-cuda"], udp=False).start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(60) == 1
    d.stop()
    assert "op-cuda: no usable CUDA GPU here" in d.output()


def test_the_scheduler_places_programs_on_op_cuda_when_it_runs():
    cpu, cuda = Actor("op-cpu").ref, Actor("op-cuda").ref
    assert Scheduler({"op-cpu": cpu, "op-cuda": cuda})._place([]) is cuda
    assert Scheduler({"op-cpu": cpu})._place([]) is cpu
    assert Scheduler({"op-cuda": cuda})._place([]) is cuda
    with pytest.raises(DeepxError, match="op-cpu or op-cuda"):
        Scheduler({})._place([])


def test_the_embedded_session_takes_its_roles_from_connect_or_the_environment(monkeypatch):
    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    monkeypatch.delenv("DEEPX_ROLES", raising=False)
    try:
        s = dx.connect(roles=["heapmem", "op-cpu"])
        assert s.transport.embedded.config.roles == ["heapmem", "op-cpu", "registry", "scheduler"]
        assert (dx.arange(4) * 2).numpy().tolist() == [0, 2, 4, 6]
        monkeypatch.setenv("DEEPX_ROLES", "op-cpu")
        s = dx.connect()
        assert s.transport.embedded.config.roles == ["op-cpu", "registry", "scheduler"]
        monkeypatch.delenv("DEEPX_ROLES")
        s = dx.connect()
        assert s.transport.embedded.config.roles == ["registry", "heapmem", "scheduler", "op-cpu"]
        with pytest.raises(DeepxError, match="roles of an embedded daemon"):
            dx.connect("unix:///nonexistent/deepxd.sock", roles=["op-cuda"])
    finally:
        dx.disconnect()


async def test_read_record_reads_a_live_memory_file_plane_without_its_lock(tmp_path):
    url = f"memory://{tmp_path}/plane.aof"
    kv = open_kv(url)
    await kv.connect()  # holds the file's lock, as a running daemon does
    try:
        fields = {"dtype": "float32", "shape": "[2, 3]", "device": "cuda:0", "bytes": "24", "kind": "heap",
                  "ipc_handle": "ab" * 64, "refcount": "1", "state": "live"}
        await kv.hset("tensor:w", fields)
        await kv.hset("tensor:w", {"refcount": "2"})
        assert read_record(url, "w") == {**fields, "refcount": "2"}
        assert read_record(url, "nope") == {}
        await kv.delete("tensor:w")
        assert read_record(url, "w") == {}
        await kv.hset("tensor:c", {"dtype": "float32", "shape": "[2]", "device": "cpu", "handle": "deepx-x-1",
                                   "state": "live"})
        with pytest.raises(DeepxError, match=r"lives on cpu, with no CUDA IPC handle.*Segment\.attach"):
            open_tensor(url, "c")
        with pytest.raises(DeepxError, match="no tensor:nope in the storage plane"):
            open_tensor(url, "nope")
    finally:
        await kv.close()
    with pytest.raises(DeepxError, match="lives inside the daemon's process"):
        read_record("memory", "w")
    with pytest.raises(DeepxError, match="cannot read the storage file"):
        read_record(f"memory://{tmp_path}/missing.aof", "w")
    with pytest.raises(DeepxError, match="use memory:///path/file or redis"):
        read_record("s3://bucket", "w")
