"""deepx_sdk.distributed and DistributedDataParallel with real ranks: processes (tests/sdk/distributed_worker.py)
connected to one real deepxd, or each to its own deepxd on a real redis-server; the process-group requests of a
daemon on their own; the single-process paths on the embedded daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import deepx_sdk as dx
import deepx_sdk.distributed as dist
import deepx_sdk.nn as nn
from deepx_core.errors import DeepxError
from tests.daemon.conftest import Daemon, eventually

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parents[2]


class Rank:
    """One rank's process."""

    def __init__(self, tmp: Path, scenario: str, address: str, world: int, rank: int, timeout: float = 20.0,
                 worlds: int | None = None, backend: str | None = None) -> None:
        self.out = tmp / f"{scenario}-{world}-{rank}-{uuid.uuid4().hex[:6]}.npz"
        self.log = self.out.with_suffix(".log")
        args = [sys.executable, str(WORKER), scenario, address, str(world), str(rank), str(self.out), str(timeout),
                str(worlds or world)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               **({"DEEPX_TEST_BACKEND": backend} if backend else {})}
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=tmp)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def result(self, timeout: float = 90.0) -> dict[str, np.ndarray]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"a rank did not end within {timeout} s:\n{self.output()}") from None
        assert self.proc.returncode == 0, self.output()
        with np.load(self.out) as f:
            return dict(f)


def train_on(tmp: Path, addresses: list[str], backend: str | None = None, wait: float = 90.0) -> None:
    """Each rank (on its address) runs every collective against numpy, then DDP, eager and under dx.compile; a
    reference process of one rank trains on the whole batches beside them: every rank ends with the same
    parameters, and with the reference's."""
    world = len(addresses)
    ranks = [Rank(tmp, "train", a, world, r, backend=backend) for r, a in enumerate(addresses)]
    reference = Rank(tmp, "train", addresses[0], 1, 0, worlds=world)
    results = [r.result(wait) for r in ranks]
    ref = reference.result(wait)
    compiled = backend != "heap" and len(set(addresses)) == world  # a step under dx.compile: one deepxd per rank
    params = [k for k in ref if not k.startswith("rank") and (compiled or not k.startswith("compiled."))]
    assert len(params) == (12 if compiled else 8)
    for k in params:
        tol = 1e-5 if "float32" in k else 1e-9
        for r, got in enumerate(results):
            np.testing.assert_array_equal(got[k], results[0][k], err_msg=f"rank {r} differs from rank 0 in {k}")
        np.testing.assert_allclose(results[0][k], ref[k], rtol=tol, atol=tol, err_msg=k)
        if k.startswith("compiled."):  # the replayed steps as the eager ones
            np.testing.assert_allclose(results[0][k], results[0][k.removeprefix("compiled.")], rtol=1e-9,
                                       atol=1e-9, err_msg=k)
    assert [list(r["rank"]) for r in results] == [[r, world] for r in range(world)]


def daemons_on(redis_url: str, tmp: Path, n: int, envs: list[dict[str, str]] | None = None) -> list[Daemon]:
    """n deepxd on one redis-server (a key prefix of their own), each a node of its own, started (`envs`: each
    one's own settings, tests/gpu's roles and GPUs)."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    daemons = [Daemon(tmp / f"n{i}", kv=redis_url, node_id=f"{prefix[:-1]}n{i}", udp=False,
                      env={"DEEPX_KV_PREFIX": prefix, **(envs[i] if envs else {})}) for i in range(n)]
    for d in daemons:
        d.tmp.mkdir()
        d.start(wait=False)
    for d in daemons:
        d.wait_ready(60)  # (a GPU daemon opens its device first)
    return daemons


@pytest.fixture
def one_deepxd(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path, udp=False).start()
    yield d
    assert d.stop() == 0, d.output()
    assert "Traceback" not in d.output(), d.output()


def test_a_session_asks_for_a_gpu_the_daemon_has_not(one_deepxd: Daemon) -> None:
    """dx.connect(device=...) places a session on a GPU of a deepxd with several; a CPU daemon has none."""
    with pytest.raises(DeepxError, match=r"place: device 'cuda:1' is not one of this daemon's GPUs \(none"):
        dx.connect(one_deepxd.address, device="cuda:1")
    s = dx.connect(one_deepxd.address, device="cpu")
    try:
        assert s.transport.placed == "cpu" and (dx.tensor([1.0]) * 2).numpy().tolist() == [2.0]
    finally:
        dx.disconnect()


def test_three_ranks_on_one_deepxd_reduce_as_numpy_and_train_as_one_process(one_deepxd: Daemon,
                                                                             tmp_path: Path) -> None:
    train_on(tmp_path, [one_deepxd.address] * 3)
    with one_deepxd.client() as c:  # the group's buffers went with it
        eventually(lambda: not [t for t in c.admin("tensors") if t["name"].startswith("dd")], timeout=10,
                   what="every buffer freed")


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_each_on_its_own_deepxd_run_collectives_over_a_ring(redis_server, tmp_path: Path, world: int) -> None:
    """Collectives are instructions that each rank's daemon runs over a ring of peer links."""
    daemons = daemons_on(redis_server.url, tmp_path, world)
    try:
        train_on(tmp_path, [d.address for d in daemons])
        for d in daemons:
            assert "collectives run in programs, over a ring of peer links" in d.output(), d.output()
            assert "maps heap tensor" not in d.output()  # nothing met through heap buffers
            assert "WARNING" not in d.output() and "Traceback" not in d.output(), d.output()
    finally:
        for d in daemons:
            assert d.stop() == 0, d.output()


def test_two_ranks_each_on_its_own_deepxd_meeting_in_the_plane(redis_server, tmp_path: Path) -> None:
    """backend='heap': each rank's reductions name the other's buffers, which its daemon maps from the other
    daemon's segments."""
    daemons = daemons_on(redis_server.url, tmp_path, 2)
    try:
        train_on(tmp_path, [d.address for d in daemons], backend="heap")
        for d in daemons:
            assert "maps heap tensor" in d.output()
            assert "WARNING" not in d.output(), d.output()  # every hold was given back, every buffer freed
    finally:
        for d in daemons:
            assert d.stop() == 0, d.output()


def killed_and_rejoined(tmp_path: Path, addresses: list[str]) -> None:
    """Three ranks; the last is killed (-9) while the others start an all_reduce: they fail within the group's
    timeout naming it, and form the group again with a rank that comes in its place."""
    timeout = 10.0
    ranks = [Rank(tmp_path, "killed", a, 3, r, timeout) for r, a in enumerate(addresses)]
    eventually(lambda: "ready to be killed" in ranks[2].output(), timeout=60, what="rank 2 ready")
    ranks[2].proc.kill()  # kill -9
    ranks[2].proc.wait()
    for r in ranks[:2]:
        eventually(lambda r=r: "failed after" in r.output() or r.proc.poll() is not None, timeout=timeout + 20,
                   what="the survivors' all_reduce fails")
        line = next(x for x in r.output().splitlines() if x.startswith("failed after"))
        assert "rank 2 (pid" in line and "exited" in line, line
        assert float(line.split()[2]) < timeout, line
    again = Rank(tmp_path, "rejoined", addresses[2], 3, 2, timeout)
    for r in [*ranks[:2], again]:
        np.testing.assert_array_equal(r.result()["sum"], np.full(4, 6.0))


def test_a_killed_rank_fails_the_others_naming_it_and_the_group_forms_again(one_deepxd: Daemon,
                                                                           tmp_path: Path) -> None:
    killed_and_rejoined(tmp_path, [one_deepxd.address] * 3)
    with one_deepxd.client() as c:  # the killed rank's buffers too: a survivor let go of them for it
        eventually(lambda: not [t for t in c.admin("tensors") if t["name"].startswith("dd")], timeout=10,
                   what="every buffer freed")


def test_a_killed_rank_fails_the_ring_naming_it_and_the_group_forms_again(redis_server, tmp_path: Path) -> None:
    """The survivors' daemons wait in the ring: one for the dead rank's part (its daemon, asked, finds it gone),
    the other for that one's, which it learns failed and why."""
    daemons = daemons_on(redis_server.url, tmp_path, 3)
    try:
        killed_and_rejoined(tmp_path, [d.address for d in daemons])
        for d in daemons:
            assert "Traceback" not in d.output(), d.output()
    finally:
        for d in daemons:
            assert d.stop() == 0, d.output()


# -- one process: the embedded daemon
@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group(world_size=1, rank=0, timeout=5)
    yield
    dist.destroy_process_group()


def test_a_group_of_one_rank_on_the_embedded_daemon(group: None) -> None:
    assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
    t = dx.tensor([1.0, 2.0])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    dist.broadcast(t, src=0)
    out = [dx.zeros(2)]
    dist.all_gather(out, t)
    dist.barrier()
    np.testing.assert_array_equal(out[0].numpy(), [1.0, 2.0])
    with pytest.raises(DeepxError, match=r"ReduceOp\.AVG of a int64 tensor"):
        dist.all_reduce(dx.tensor([1, 2]), op="mean")
    with pytest.raises(DeepxError, match="already initialized"):
        dist.init_process_group(world_size=1, rank=0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(2, 1))
    model(dx.ones(3, 2)).sum().backward()
    assert model.module.weight.grad is not None


def test_a_collective_starts_as_soon_as_its_tensor_is_ready(group: None) -> None:
    """The daemon's op worker starts an all-reduce right after the instruction that made its tensor, ahead of its
    place in the program (the instructions between run meanwhile), checked whole and then prepared."""
    comm = dx.session().transport.embedded.node.comm
    before = comm.early
    x = dx.tensor(np.arange(6.0))
    for _ in range(4):  # the same program: checked whole, then run as prepared
        g = x * 3.0
        y = (x + 1.0).exp().sum()  # between g and its all-reduce: nothing of g
        dist.all_reduce(g, op=dist.ReduceOp.AVG, async_op=True)
        z = g * 2.0
        np.testing.assert_allclose(z.numpy(), np.arange(6.0) * 6)
        assert np.isclose(y.item(), np.exp(np.arange(6.0) + 1).sum())
    assert comm.early - before == 4


def test_distributed_refuses_what_it_cannot_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DeepxError, match="has not been initialized"):
        dist.all_reduce(dx.tensor([1.0]))
    with pytest.raises(DeepxError, match="NCCL cannot serve these ranks: rank 0 runs on op-cpu"):
        dist.init_process_group("nccl", world_size=1, rank=0)  # (an embedded session of the CPU roles)
    assert not dist.is_initialized()
    with pytest.raises(DeepxError, match="backend 'mpi' is not available"):
        dist.init_process_group("mpi", world_size=1, rank=0)
    with pytest.raises(DeepxError, match="world_size 2 needs the ranks' sessions on a running deepxd"):
        dist.init_process_group(world_size=2, rank=0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(DeepxError, match="set WORLD_SIZE in the environment"):
        dist.init_process_group()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    dist.init_process_group(timeout=5)  # as torchrun starts a script
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    dist.destroy_process_group()
    assert not dist.is_initialized()


def test_post_accumulate_grad_hooks_run_after_each_backward() -> None:
    w = dx.tensor([1.0, 2.0], requires_grad=True)
    seen: list[list[float]] = []
    handle = w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.tolist()))
    (w * 3).sum().backward()
    (w * 2).sum().backward()
    handle.remove()
    (w * 2).sum().backward()
    assert seen == [[3.0, 3.0], [5.0, 5.0]]
    with pytest.raises(DeepxError, match="only leaf tensors"):
        (w * 2).register_post_accumulate_grad_hook(print)


@pytest.mark.parametrize("backend", ["ring", "heap"])
def test_two_ranks_on_two_hosts_reduce_over_the_peer_links(redis_server, tmp_path: Path, backend: str) -> None:
    """Each rank's daemon says it runs on a host of its own: the ring reads over TCP (with the token); meeting in
    the plane, the other rank's buffers are not mapped but streamed over the peer link. Either way the ranks train
    as one process."""
    from tests.daemon.conftest import eventually
    from tests.daemon.test_cluster import Cluster
    from tests.daemon.test_peers import hosts, nodes

    cluster = Cluster(tmp_path, redis_server.url)
    try:
        daemons = hosts(cluster, tmp_path, "host-a", "host-b")
        eventually(lambda: all(nodes(d)[o.node_id]["link"] == "none" for d, o in zip(daemons, daemons[::-1])),
                   what="each knows the other, and no link is open yet")
        train_on(tmp_path, [d.address for d in daemons], backend)
        for d, other in zip(daemons, daemons[::-1]):
            assert nodes(d)[other.node_id]["link"] == "tcp"  # opened by the ring (or the reads), kept peer_idle_s
            if backend == "ring":
                assert f"(node {other.node_id}) over tcp://" in d.output(), d.output()  # the ring's link
            else:
                assert f"linked to node {other.node_id} over tcp://" in d.output(), d.output()
            assert "maps heap tensor" not in d.output()  # nothing shared by memory: another host's tensors stream
            assert "Traceback" not in d.output(), d.output()
    finally:
        cluster.stop()
