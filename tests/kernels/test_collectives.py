"""The collective family (allreduce, broadcast, allgather, reducescatter) against numpy.

The ring's schedules (deepxd/ring.py) run here for 1 to 5 ranks in one process, every rank's units applied as its
predecessor publishes them and as the rules of the ring allow (a rank writes memory it published only once its
successor has it): every rank ends with numpy's result, for every dtype the ops claim, on sizes the world divides
and sizes it does not; a schedule that could stall would stall here. The kernels themselves run on a CpuExecutor in
a process group of one rank; over real ranks, each on a deepxd of its own, in tests/sdk/test_distributed.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy
from deepx_core.ir.ops import OPS, check_program
from deepx_core.ir.text import parse_text
from deepxd import ring
from deepxd.comm import Collectives, early_launches
from deepxd.kernels.cpu import CpuExecutor

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reducescatter")
DTYPES = sorted(OPS["allreduce"].dtypes)
#: numpy's reduction of each op over the ranks (axis 0)
REFERENCE = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "product": np.prod}


def simulate(scheds: list[ring.Schedule], arrays: list[list[np.ndarray]], combine) -> None:
    """Run every rank's schedule: a receive goes when the predecessor has published its unit and the successor has
    every unit the receive overwrites (ring.run's rules); AssertionError where the ranks stall."""
    n = len(scheds)
    done = [0] * n

    def ready(p: int) -> int:
        s, k = scheds[p], 0
        while k < len(s.pubs) and s.pub_dep[k] <= done[p]:
            k += 1
        return k

    moved = True
    while moved:
        moved = False
        for p in range(n):
            s, prev, succ = scheds[p], (p - 1) % n, (p + 1) % n
            while done[p] < len(s.recvs):
                j = done[p]
                if s.wait[j] > done[succ] or ready(prev) <= j:
                    break
                u, pu = s.recvs[j], scheds[prev].pubs[j]
                assert u == pu, f"rank {p} receives {u} where rank {prev} publishes {pu}"
                got = arrays[prev][pu.array][pu.start:pu.stop].copy()
                dest = arrays[p][u.array][u.start:u.stop]
                if s.combine[j]:
                    combine(dest, got, out=dest)
                else:
                    dest[...] = got
                done[p] += 1
                moved = True
    assert all(done[p] == len(scheds[p].recvs) for p in range(n)), f"the ring stalls: {done}"


def values(rng: np.random.Generator, dtype: str, size: int) -> np.ndarray:
    if np.dtype(to_numpy(dtype)).kind == "i":
        return rng.integers(-3, 4, size).astype(to_numpy(dtype))
    return rng.uniform(0.5, 1.5, size).astype(to_numpy(dtype))


def close(dtype: str) -> dict[str, float]:
    return {"float64": {"rtol": 1e-12}, "float32": {"rtol": 1e-5}}.get(dtype, {"rtol": 3e-2}) if dtype in (
        "float64", "float32", "float16", "bfloat16") else {"rtol": 0}


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_over_the_ring_gives_every_rank_numpys_result(dtype: str, rng: np.random.Generator) -> None:
    hows = [h for h in REFERENCE if h != "mean" or dtype in ("float64", "float32", "float16", "bfloat16")]
    for world in range(1, 6):
        for sizes in ([1], [7], [2, 3], [10, 0, 5], [31]):  # a bucket of several tensors, sizes world does not divide
            for chunk in (1, 3, 64):
                for how in hows:
                    ins = [[values(rng, dtype, k) for k in sizes] for _ in range(world)]
                    arrays = [[a.copy() for a in mine] for mine in ins]
                    simulate([ring.all_reduce(sizes, world, p, chunk) for p in range(world)], arrays,
                             ring.COMBINE[how])
                    for p in range(world):
                        for k in range(len(sizes)):
                            got = arrays[p][k] / world if how == "mean" else arrays[p][k]
                            stacked = np.stack([ins[r][k] for r in range(world)])
                            want = (REFERENCE[how](stacked, 0).astype(stacked.dtype) if stacked.dtype.kind == "i"
                                    else REFERENCE[how](stacked.astype(np.float64), 0))  # (integers wrap)
                            np.testing.assert_allclose(got.astype(np.float64), want, **close(dtype),
                                                       err_msg=f"allreduce {how} {world} ranks {sizes}")
                            np.testing.assert_array_equal(arrays[p][k], arrays[0][k])  # the same bits everywhere


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_allgather_and_reducescatter_over_the_ring(dtype: str, rng: np.random.Generator) -> None:
    for world in range(1, 6):
        for chunk in (1, 2, 64):
            sizes = [5, 2]
            ins = [[values(rng, dtype, k) for k in sizes] for _ in range(world)]
            for src in range(world):
                arrays = [[a.copy() for a in mine] for mine in ins]
                simulate([ring.broadcast(sizes, world, p, src, chunk) for p in range(world)], arrays, None)
                for p in range(world):
                    for k in range(len(sizes)):
                        np.testing.assert_array_equal(arrays[p][k], ins[src][k], err_msg=f"broadcast from {src}")
            m = 3
            blocks = [values(rng, dtype, m) for _ in range(world)]
            gathered = []
            for p in range(world):  # each rank's own block in place, as the allgather kernel puts it
                out = np.zeros(world * m, to_numpy(dtype))
                out[p * m:(p + 1) * m] = blocks[p]
                gathered.append([out])
            simulate([ring.all_gather(world * m, world, p, chunk) for p in range(world)], gathered, None)
            for p in range(world):
                np.testing.assert_array_equal(gathered[p][0], np.concatenate(blocks), err_msg="allgather")
            whole = [values(rng, dtype, world * m) for _ in range(world)]
            work = [[w.copy()] for w in whole]
            simulate([ring.reduce_scatter(world * m, world, p, chunk) for p in range(world)], work, np.add)
            for p in range(world):
                stacked = np.stack(whole)
                want = (np.sum(stacked, 0, dtype=stacked.dtype) if stacked.dtype.kind == "i"
                        else np.sum(stacked.astype(np.float64), 0))[p * m:(p + 1) * m]
                np.testing.assert_allclose(work[p][0][p * m:(p + 1) * m].astype(np.float64), want, **close(dtype),
                                           err_msg="reducescatter")


def solo() -> CpuExecutor:
    """An executor whose process group "default" has one rank, as a daemon holds one."""
    comm = Collectives()
    comm.formed("default", "g1", 0, [{"node": "here"}], 5.0)
    ex = CpuExecutor()
    ex.collectives = comm
    return ex


@pytest.mark.parametrize("dtype", DTYPES)
def test_collectives_in_a_group_of_one_rank_are_the_identity(dtype: str, rng: np.random.Generator) -> None:
    ex = solo()
    a = values(rng, dtype, 12).reshape(4, 3)
    ex.put("a", a)
    mean = "mean" if dtype in ("float64", "float32", "float16", "bfloat16") else "sum"
    ex.run_all(parse_text(f"""
        allreduce (tensor<{dtype}>:a, var<string>:{mean}, var<string>:default) -> (tensor<{dtype}>:r)
        broadcast (tensor<{dtype}>:a, var<int32>:0, var<string>:default) -> (tensor<{dtype}>:b)
        allgather (tensor<{dtype}>:a, var<int32>:1, var<string>:default) -> (tensor<{dtype}>:g)
        reducescatter (tensor<{dtype}>:a, var<int32>:1, var<string>:max, var<string>:default) -> (tensor<{dtype}>:s)
        copytensor (tensor<{dtype}>:a) -> (tensor<{dtype}>:i)
        allreduce (tensor<{dtype}>:i, var<string>:product) -> (tensor<{dtype}>:i)
    """))
    for name in "rbgsi":
        np.testing.assert_array_equal(ex.get(name), a, err_msg=name)
    assert all(OPS[op].family == "collective" and OPS[op].effect.io for op in COLLECTIVES)  # never dropped or merged


def test_bad_collectives_are_refused_naming_the_op_and_the_problem() -> None:
    ex = solo()
    ex.put("a", np.ones((4, 3), np.float32))
    ex.put("n", np.ones(3, np.int64))
    cases = {
        "allreduce (tensor:n, var<string>:mean) -> (tensor:x)":
            "allreduce: the mean of 'n' \\(int64\\) is not an integer",
        "allreduce (tensor:a, var<string>:avg) -> (tensor:x)": "allreduce: op 'avg' is not one of sum, mean",
        "allgather (tensor:a, var<int32>:2, var<string>:default) -> (tensor:x)":
            "allgather: world 2 is not the size of process group 'default' \\(1\\)",
        "reducescatter (tensor:a, var<int32>:3, var<string>:sum, var<string>:default) -> (tensor:x)":
            "cannot be split into 3 equal blocks",
        "broadcast (tensor:a, var<int32>:1, var<string>:default) -> (tensor:x)":
            "broadcast: src 1 is not a rank of process group 'default'",
        "allreduce (tensor:a, var<string>:sum, var<string>:other) -> (tensor:x)":
            "allreduce: no process group 'other' on this daemon",
        "allreduce (tensor:a, var<string>:sum, var<string>:a:b) -> (tensor:x)": "is not a process group's name",
    }
    for text, message in cases.items():
        with pytest.raises(DeepxError, match=message):
            ex.run_all(parse_text(text))
    assert "x" not in ex.tensors
    bare = CpuExecutor()
    bare.put("a", np.ones(2))
    with pytest.raises(DeepxError, match="allreduce: this executor runs no collectives"):
        bare.run_all(parse_text("allreduce (tensor:a) -> (tensor:a)"))


def test_collectives_start_once_their_tensors_are_ready() -> None:
    """early_launches: a bucket (consecutive collectives marked alike) starts after the last instruction before it
    that names one of its tensors, and never before the bucket before it."""
    ex = CpuExecutor()
    for n in "abcd":
        ex.put(n, np.ones(2))
    bounds = check_program(parse_text("""
        mulscalar (tensor:a, var<float64>:2) -> (tensor:g1)
        mulscalar (tensor:b, var<float64>:2) -> (tensor:g2)
        mulscalar (tensor:c, var<float64>:2) -> (tensor:g3)
        mulscalar (tensor:d, var<float64>:2) -> (tensor:x)
        add (tensor:x, tensor:x) -> (tensor:x)
        allreduce (tensor:g2, var<string>:mean) -> (tensor:g2) // bucket=0
        allreduce (tensor:g1, var<string>:mean) -> (tensor:g1) // bucket=0
        allreduce (tensor:g3, var<string>:mean) -> (tensor:g3) // bucket=1
        allreduce (tensor:a) -> (tensor:a)
        add (tensor:g1, tensor:g2) -> (tensor:y)
        allreduce (tensor:y) -> (tensor:y)
    """), ex)
    # bucket 0 (g2, g1) after g2 is made; bucket 1 (g3) after g3; `a` only read before: at the first of it, but
    # after bucket 1 (the order every rank starts them in); y once made
    assert early_launches(bounds) == {1: [[5, 6]], 2: [[7], [8]], 9: [[10]]}


def test_the_formation_picks_nccl_only_where_every_rank_has_a_gpu_of_its_own_with_nccl() -> None:
    """backend_of: the same answer on every rank (it reads the same records); NCCL takes one rank per GPU."""
    from deepxd.comm import backend_of, why_not_nccl

    def m(node: str, gpu: str | None = None, worker: str = "op-cuda", **more: object) -> dict[str, object]:
        return {"node": node, "worker": worker, "host": "h", **({"gpu": gpu, "nccl": True} if gpu else {}), **more}

    assert backend_of([m("a", "g0"), m("b", "g1")]) == "nccl"
    assert backend_of([m("a", "g0"), m("a", "g1", worker="op-cuda:1")]) == "nccl"  # two GPUs of one daemon
    assert backend_of([m("a", "g0", backend="ring"), m("b", "g1")]) == "ring"  # rank 0 asked for the ring
    assert backend_of([m("a", "g0"), m("b", "g0")]) == "ring"  # one GPU: staged through host memory
    assert why_not_nccl([m("a", "g0"), m("b", "g0")]) == ("ranks 0 and 1 share GPU g0 of host h (NCCL takes one "
                                                          "rank per GPU)")
    assert backend_of([m("a", "g0"), m("b", worker="op-cpu")]) == "ring"  # a mixed group
    assert "rank 1 runs on op-cpu of node b, not on a GPU" in why_not_nccl([m("a", "g0"), m("b", worker="op-cpu")])
    assert "NCCL does not load on node b" in why_not_nccl([m("a", "g0"), {**m("b", "g1"), "nccl": False}])
    assert backend_of([m("a"), m("a")]) == ""  # one worker for both: requests meeting in the plane
    assert backend_of([{"node": "here"}]) == "ring"


class _Ends:
    """What deepxd/comm_gpu.py asks of an NCCL communicator when a formation ends (abort, destroy, closed), with the
    thread of each call: NCCL does not load on this machine, and these tests are about who calls them, and where."""

    def __init__(self) -> None:
        self.closed = False
        self.calls: list[tuple[str, str]] = []

    def abort(self) -> None:
        import threading

        if not self.closed:
            self.closed = True
            self.calls.append(("abort", threading.current_thread().name))

    def destroy(self) -> None:
        import threading

        if not self.closed:
            self.closed = True
            self.calls.append(("destroy", threading.current_thread().name))


@pytest.mark.parametrize("why", ["it was formed again", "its rank left"])
def test_a_formation_dropped_from_the_loop_leaves_its_communicator_to_its_worker(why: str) -> None:
    """_drop runs on the event loop while the worker's thread may wait in a collective of the formation (its peer
    gone): the communicator stays with the formation until the worker's thread ends it, so that the failing wait
    aborts it there (its kernels would otherwise hold the stream, and the deferred end would queue behind a wait for
    that stream); the end handed to the worker then does nothing more. Left cleanly and idle: destroyed there."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from deepxd.comm import Formation
    from deepxd.comm_gpu import _fail

    comm = Collectives()
    c = _Ends()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker")
    f = Formation("g", "gen1", 0, 2, ["a", "b"], [{}, {}], 5.0, backend="nccl", nccl=c,
                  nccl_close=lambda fn: worker.submit(fn) and None)
    comm.formations["g", 0] = f
    waiting, release = threading.Event(), threading.Event()

    def in_flight() -> None:  # the collective's wait on the worker's thread: the group breaks under it
        waiting.set()
        release.wait(10)
        if f.broken is not None:
            _fail(f, f.broken)

    try:
        if why == "it was formed again":
            job = worker.submit(in_flight)
            assert waiting.wait(10)
        comm.left("g", "gen1") if why == "its rank left" else comm._drop(comm.formations.pop(("g", 0)), why)
        assert f.broken is not None
        if why == "it was formed again":
            assert f.nccl is c and not c.closed  # not taken from the loop: the wait still finds it
            release.set()
            job.result(10)
        worker.submit(lambda: None).result(10)  # the deferred end has run
        assert f.nccl is None and c.closed
        want = "abort" if why == "it was formed again" else "destroy"
        assert [(what, thread.split("_")[0]) for what, thread in c.calls] == [(want, "worker")], c.calls
    finally:
        release.set()
        worker.shutdown(wait=True)
