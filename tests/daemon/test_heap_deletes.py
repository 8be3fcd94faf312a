"""Deleting a heap tensor keeps the plane true: a deltensor releases only the program's worker's hold (and is refused
where the worker holds none), and a native delete's `force` is a bool, never coerced."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from tests.daemon.conftest import Daemon, eventually


def heap_row(c, name: str) -> dict | None:
    return next((t for t in c.admin("tensors") if t["name"] == name and t["kind"] == "heap"), None)


def test_deltensor_of_a_heap_tensor_another_holds_is_refused_and_the_plane_stays_true(daemon: Daemon):
    with daemon.client() as c:
        c.put("theirs", np.ones(4, np.float32), heap=True, owner="trainer")
        c.put("ours", np.ones(4, np.float32), heap=True)
        r = c.run(parse_text("deltensor () -> (tensor<float32>:theirs)"))
        assert r.error and "'theirs'" in r.error and "held by others" in r.error and r.done == 0, r.error
        row = heap_row(c, "theirs")
        assert row is not None and row["refcount"] == 1 and row["holders"] == "trainer"
        assert c.fetch("theirs")["theirs"].tolist() == [1.0] * 4  # still there, as the plane says
        c.run(parse_text("deltensor () -> (tensor<float32>:ours)")).raise_for_error()
        assert heap_row(c, "ours") is None  # the worker's own: freed


@pytest.fixture
def on_redis(tmp_path, redis_server):
    """A daemon on a Redis plane of its own prefix, and a way to push lifecycle commands as another process does."""
    import uuid

    import msgpack
    import redis

    prefix = f"hr{uuid.uuid4().hex[:8]}:"
    d = Daemon(tmp_path, kv=redis_server.url, env={"DEEPX_KV_PREFIX": prefix}).start()
    r = redis.Redis.from_url(redis_server.url)

    def push(**cmd) -> None:
        r.rpush(f"{prefix}tensor_lifecycle", msgpack.packb(cmd))

    yield d, push
    r.close()
    assert d.stop() == 0, d.output()


def _held_twice(c, push, name: str) -> None:
    """A heap tensor `name` held by the worker (its put) and by another process, `reader`."""
    c.put(name, np.ones(4, np.float32), heap=True)
    push(cmd="get", name=name, holder="reader")
    eventually(lambda: heap_row(c, name)["refcount"] == 2, 10, "the reader's hold")


def test_a_native_delete_refuses_a_force_that_is_not_a_bool(on_redis):
    d, push = on_redis
    with d.client() as c:
        _held_twice(c, push, "w")
        for bad in ("no", 0, 1, None, "false"):
            with pytest.raises(DeepxError, match=r"delete of 'w': 'force' must be true or false, got"):
                c.request("delete", name="w", force=bad)
        assert heap_row(c, "w")["refcount"] == 2  # "no" once force-deleted it
        with pytest.raises(DeepxError, match="still referenced 2 times"):
            c.request("delete", name="w", force=False)
        assert c.request("delete", name="w", force=True)["tensor"]["forced"] is True
        assert heap_row(c, "w") is None


def test_deltensor_of_a_shared_heap_tensor_releases_only_the_workers_hold(on_redis):
    d, push = on_redis
    with d.client() as c:
        _held_twice(c, push, "s")
        c.run(parse_text("deltensor () -> (tensor<float32>:s)")).raise_for_error()
        row = heap_row(c, "s")
        assert row is not None and row["refcount"] == 1 and row["holders"] == "reader", row
        push(cmd="delete", name="s", holder="reader")
        eventually(lambda: heap_row(c, "s") is None, 10, "freed when the reader let go")
