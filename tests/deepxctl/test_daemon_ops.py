"""The two daemon additions deepxctl needs, over the native protocol: the `delete` request op (tensors rm) and the
`graphs` admin query (graphs ls/show)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import redis

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from deepx_core.ir.wire import pack_program, unpack_program
from tests.deepxctl.conftest import Live, wait_for


def test_delete_stack_tensor(live: Live) -> None:
    with live.daemon.client() as c:
        c.put("d_stack", np.zeros((3,), np.int64))
        info = c.request("delete", name="d_stack")["tensor"]
        assert info == {"name": "d_stack", "kind": "stack", "bytes": 24, "node": live.node, "forced": False}
        with pytest.raises(DeepxError, match="'d_stack' not found"):
            c.fetch("d_stack")
        with pytest.raises(DeepxError, match=f"delete: no tensor named 'd_stack' on node {live.node}"):
            c.request("delete", name="d_stack")
        with pytest.raises(DeepxError, match="delete: 'name' must be a tensor name"):
            c.request("delete", name="")


def test_routine_lookups_are_not_counted_as_actor_errors(live: Live) -> None:
    """Deleting stack tensors asked heapmem about a heap tensor of that name, and each miss counted as one of its
    errors: `deepxctl actors ls` showed a failing heapmem (found in a docs audit)."""
    with live.daemon.client() as c:
        def heapmem_errors() -> int:
            return next(int(r["errors"]) for r in c.admin("actors") if r["name"] == "heapmem")

        before = heapmem_errors()
        for k in range(3):
            c.put(f"look{k}", np.zeros((2,), np.float32))
            c.request("delete", name=f"look{k}")
        c.put("look_heap", np.zeros((2,), np.float32), heap=True)  # a put of a new heap name looks it up first
        assert heapmem_errors() == before


def test_delete_heap_tensor_frees_it_everywhere(live: Live) -> None:
    with live.daemon.client() as c:
        c.put("d_heap", np.ones((5,), np.float32), heap=True, owner="loader")  # held by its owner, viewed by op-cpu
        assert c.request("delete", name="d_heap")["tensor"]["kind"] == "heap"
        assert "d_heap" not in {t["name"] for t in c.admin("tensors")}
        assert "d_heap" not in {h["name"] for h in c.admin("memory")["heap"]}
        c.put("d_heap", np.full((2,), 3, np.float32), heap=True)  # the name is free again
        assert c.fetch("d_heap")["d_heap"].tolist() == [3.0, 3.0]
        c.request("delete", name="d_heap")


def test_delete_refuses_shared_heap_tensor_unless_forced(live: Live) -> None:
    plane = redis.Redis.from_url(live.redis_url)
    with live.daemon.client() as c:
        c.put("d_shared", np.ones((4,), np.float32), heap=True)
        plane.rpush(f"{live.prefix}tensor_lifecycle",
                    msgpack.packb({"cmd": "get", "name": "d_shared", "holder": "reader"}))
        wait_for(lambda: any(t["name"] == "d_shared" and t.get("refcount") == 2 for t in c.admin("tensors")),
                 what="the reader's reference")
        with pytest.raises(DeepxError, match=r"still referenced 2 times \(held by op-cpu, reader\)"):
            c.request("delete", name="d_shared")
        assert c.fetch("d_shared")["d_shared"].tolist() == [1.0] * 4  # refused: nothing changed
        info = c.request("delete", name="d_shared", force=True)["tensor"]
        assert info["forced"] is True
        assert "d_shared" not in {t["name"] for t in c.admin("tensors")}
        assert not plane.exists(f"{live.prefix}tensor:d_shared")


def test_delete_names_the_node_of_a_foreign_tensor(live: Live) -> None:
    plane = redis.Redis.from_url(live.redis_url)
    plane.hset(f"{live.prefix}tensor:d_far", mapping={"kind": "heap", "node": "elsewhere", "dtype": "float32",
                                                       "shape": "[1]", "bytes": "4"})
    try:
        with live.daemon.client() as c, pytest.raises(DeepxError) as caught:
            c.request("delete", name="d_far")  # asked of that node, which the plane does not know
        assert "heap tensor 'd_far' of node elsewhere: node elsewhere is not in the storage plane" in str(caught.value)
    finally:
        plane.delete(f"{live.prefix}tensor:d_far")


def test_admin_graphs(live: Live) -> None:
    plane = redis.Redis.from_url(live.redis_url)
    program = parse_text("exp (tensor:a) -> (tensor:b)")
    plane.set(f"{live.prefix}graph:g1", pack_program(program))
    plane.hset(f"{live.prefix}graph:wrongtype", mapping={"a": "b"})
    try:
        with live.daemon.client() as c:
            rows = {g["name"]: g for g in c.admin("graphs")}
        assert unpack_program(rows["g1"]["data"]) == program
        assert rows["wrongtype"]["data"] is None and "WRONGTYPE" in rows["wrongtype"]["error"]
    finally:
        plane.delete(f"{live.prefix}graph:g1", f"{live.prefix}graph:wrongtype")


def test_unknown_request_op_lists_delete(live: Live) -> None:
    known = ("known: admin, backward, coll_read, delete, executor_register, explain, fetch, graph_drop, graph_get, "
             "graph_rm, "
             "graph_store, group_barrier, group_join, group_leave, hello, label, peer_hold, peer_ping, peer_read, "
             "peer_run, ping, place, put, release_on_close, replay, run, udp_share")
    with live.daemon.client() as c, pytest.raises(DeepxError, match=known):
        c.request("frobnicate")


def test_a_heap_tensor_freed_through_the_lifecycle_list_is_gone_from_the_worker_too(live: Live) -> None:
    """A lifecycle `delete` frees the memory; op-cpu, which viewed it, forgets the view, so a later program cannot
    read or write memory that is gone or that a new heap tensor now holds."""
    plane = redis.Redis.from_url(live.redis_url)
    with live.daemon.client() as c:
        c.put("d_life", np.full((256,), 5, np.float32), heap=True)
        plane.rpush(f"{live.prefix}tensor_lifecycle", msgpack.packb({"cmd": "delete", "name": "d_life"}))
        wait_for(lambda: "d_life" not in {t["name"] for t in c.admin("tensors")}, what="the delete")
        c.put("d_next", np.full((256,), 9, np.float32), heap=True)  # same size: it could take the freed memory
        with pytest.raises(DeepxError, match="'d_life' not found"):
            c.fetch("d_life")
        r = c.run(parse_text("addscalar (tensor:d_life, var:1) -> (tensor:d_life)"))
        assert not r.ok and r.done == 0 and "'d_life' not found" in r.error
        assert (c.fetch("d_next")["d_next"] == 9).all()  # untouched
        c.request("delete", name="d_next")


def test_put_onto_a_heap_tensor_of_another_shape_is_refused(live: Live) -> None:
    with live.daemon.client() as c:
        c.put("d_other", np.ones((4,), np.float32), heap=True, owner="loader")  # op-cpu views, loader holds
        r = c.run(parse_text("deltensor () -> (tensor:d_other)"))  # op-cpu holds no reference: it cannot free it
        assert not r.ok and "held by others" in (r.error or "")
        with pytest.raises(DeepxError, match=r"put: heap tensor 'd_other' is float32\[4\]; it cannot take "
                                             r"float32\[8\]"):
            c.put("d_other", np.zeros((8,), np.float32), heap=True)
        c.put("d_other", np.full((4,), 2, np.float32), heap=True)  # the right shape attaches and writes
        assert c.fetch("d_other")["d_other"].tolist() == [2.0] * 4
        c.request("delete", name="d_other", force=True)
