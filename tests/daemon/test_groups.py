"""The process-group requests of deepxd (deepxd/groups.py: group_join, group_barrier, group_leave) over the native
socket, with the client standing for the ranks; tests/sdk/test_distributed.py runs real ranks through the SDK."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from deepx_core.errors import DeepxError
from deepx_sdk.client import NativeClient
from tests.daemon.conftest import Daemon


def test_group_requests_fail_naming_who_did_not_come(daemon: Daemon) -> None:
    me = {"pid": os.getpid(), "host": os.uname().nodename}
    with daemon.client() as c:
        with pytest.raises(DeepxError, match=r"ranks 1 of 2 did not join within 0.3 s"):
            c.request("group_join", group="g1", world_size=2, rank=0, timeout=0.3, **me)
        with pytest.raises(DeepxError, match="rank 0 did not form it"):
            c.request("group_join", group="g2", world_size=2, rank=1, timeout=0.3, **me)
        with pytest.raises(DeepxError, match="rank 2 is out of range for world_size 2"):
            c.request("group_join", group="g3", world_size=2, rank=2, timeout=1, **me)
        with pytest.raises(DeepxError, match="'world_size' must be a whole number"):
            c.request("group_join", group="g3", world_size="2", rank=0, timeout=1, **me)
        with pytest.raises(DeepxError, match="the name must be"):
            c.request("group_join", group="a b", world_size=1, rank=0, timeout=1, **me)
        gen = c.request("group_join", group="g4", world_size=1, rank=0, timeout=1, **me)["gen"]
        c.request("group_barrier", group="g4", gen=gen, rank=0, seq=0, timeout=1)
        with NativeClient(daemon.address, timeout=10) as other:  # another process's rank 0, while this one runs
            with pytest.raises(DeepxError, match="is in use: its rank 0 is pid"):
                other.request("group_join", group="g4", world_size=1, rank=0, timeout=1,
                              **{**me, "pid": os.getppid()})
        c.request("group_leave", group="g4", gen=gen, rank=0)
    with daemon.client() as a, daemon.client() as b:
        # two ranks of one process (it stands for both): rank 1 joins, rank 0 forms, both answered
        answers: dict[int, dict[str, Any]] = {}
        threads = [threading.Thread(target=lambda r=r, c=c: answers.__setitem__(r, c.request(
            "group_join", group="g5", world_size=2, rank=r, timeout=10, **me))) for r, c in ((1, b), (0, a))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gen = answers[0]["gen"]
        assert answers[1]["gen"] == gen and set(answers[0]["members"]) == {"0", "1"}
        started = time.monotonic()
        with pytest.raises(DeepxError, match=r"all_reduce #0 on process group 'g5': rank 1 \(pid \d+ on node "
                                             r"[^)]+\) did not reach it within 0.5 s"):
            a.request("group_barrier", group="g5", gen=gen, rank=0, seq=0, timeout=0.5, what="all_reduce #0")
        assert time.monotonic() - started < 5
        b.request("group_barrier", group="g5", gen=gen, rank=1, seq=0, timeout=5)  # rank 0 reached it already
        b.request("group_leave", group="g5", gen=gen, rank=1)
        with pytest.raises(DeepxError, match=r"rank 1 left the group .* before it reached this one"):
            a.request("group_barrier", group="g5", gen=gen, rank=0, seq=1, timeout=5, what="barrier #1")


async def test_rank_0_makes_the_nccl_id_only_where_the_whole_formation_runs_on_nccl() -> None:
    """Making an ncclUniqueId starts NCCL's bootstrap root in rank 0's daemon, a thread that waits for the ranks'
    communicators without end: it is made once the formation is whole and its backend is NCCL, never for one that
    runs over the ring; the others wait for it, and take only their formation's. Where NCCL does not load on rank
    0's daemon (this machine, unless DEEPX_NCCL names a libnccl), the ranks are told why."""
    from deepxd.groups import _nccl_id, _nccl_id_known
    from deepxd.kernels.cuda.nccl import available
    from deepxd.kv.base import open_kv

    kv = open_kv("memory")
    await kv.connect()
    try:
        class Plane:  # what _nccl_id_known uses of the daemon's Node: its storage plane (and it as a key)
            def __init__(self) -> None:
                self.kv = kv

        node: Any = Plane()

        def gpu(n: str, **more: object) -> dict[str, Any]:
            return {"node": n, "worker": "op-cuda", "host": "h", "gpu": f"bus-{n}", "nccl": True, **more}

        ring = [gpu("a"), {"node": "b", "worker": "op-cpu", "host": "h"}]  # a mixed group: the ring
        for rank in (0, 1):
            assert await _nccl_id_known(node, "group:g", "g", "gen1", rank, {}, ring)
        assert await kv.hgetall("group:g") == {}  # no id made
        on_nccl = [gpu("a"), gpu("b")]
        stale = {"nccl": "gen0:" + "ab" * 128}  # an earlier formation's
        assert not await _nccl_id_known(node, "group:g", "g", "gen1", 1, dict(stale), on_nccl)  # waits for rank 0
        record = dict(stale)
        if available() is None:
            assert await _nccl_id_known(node, "group:g", "g", "gen1", 0, record, on_nccl)
            made = await kv.hgetall("group:g")
            assert made["nccl"].startswith("gen1:") and record == made
            nid = _nccl_id(made, "gen1")
            assert nid is not None and len(nid) == 128 and _nccl_id(made, "gen0") is None
            assert await _nccl_id_known(node, "group:g", "g", "gen1", 1, made, on_nccl)
        else:
            with pytest.raises(DeepxError, match=r"process group 'g': rank 0's daemon could not make NCCL's unique "
                                                  r"id: NCCL: libnccl.so not found"):
                await _nccl_id_known(node, "group:g", "g", "gen1", 0, record, on_nccl)
            made = await kv.hgetall("group:g")
            with pytest.raises(DeepxError, match="rank 0's daemon could not make NCCL's unique id"):
                await _nccl_id_known(node, "group:g", "g", "gen1", 1, made, on_nccl)  # told, not left waiting
            assert _nccl_id(made, "gen1") is None
    finally:
        await kv.close()
