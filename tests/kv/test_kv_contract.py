"""The KV contract (deepxd/kv/base.py), run against every backend: memory, memory persisted to a file, real Redis."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from deepx_core.errors import DeepxError
from deepxd.kv.base import KV, open_kv

EVERY_BYTE = bytes(range(256))


# strings


async def test_get_set_overwrite_and_missing(kv: KV) -> None:
    assert await kv.get("graph:g") is None
    await kv.set("graph:g", b"v1")
    assert await kv.get("graph:g") == b"v1"
    await kv.set("graph:g", b"v2")
    assert await kv.get("graph:g") == b"v2"
    assert await kv.exists("graph:g")
    assert not await kv.exists("graph:other")


async def test_set_if_absent_sets_only_a_new_key(kv: KV) -> None:
    assert await kv.set_if_absent("graph:g", b"v1")
    assert not await kv.set_if_absent("graph:g", b"v2")
    assert await kv.get("graph:g") == b"v1"
    await kv.hset("node:n", {"state": "running"})
    assert not await kv.set_if_absent("node:n", b"x")  # a key of another type stands too
    assert await kv.hgetall("node:n") == {"state": "running"}


async def test_binary_values_keep_every_byte(kv: KV) -> None:
    await kv.set("bin", EVERY_BYTE * 3)
    await kv.set("empty", b"")
    await kv.set("big", EVERY_BYTE * 8192)  # 2 MiB
    await kv.set("view", memoryview(bytearray(b"\x00\xff")))
    assert await kv.get("bin") == EVERY_BYTE * 3
    assert await kv.get("empty") == b""
    assert await kv.exists("empty")
    assert await kv.get("big") == EVERY_BYTE * 8192
    assert await kv.get("view") == b"\x00\xff"
    await kv.rpush("list", *(bytes([i]) for i in range(256)), EVERY_BYTE, b"")
    assert await kv.lrange("list", 0, 255) == [bytes([i]) for i in range(256)]
    assert await kv.lrange("list", -2, -1) == [EVERY_BYTE, b""]


async def test_values_must_be_bytes(kv: KV) -> None:
    with pytest.raises(DeepxError, match="bytes"):
        await kv.set("k", "text")  # type: ignore[arg-type]
    with pytest.raises(DeepxError, match="bytes"):
        await kv.rpush("l", b"ok", 3)  # type: ignore[arg-type]
    with pytest.raises(DeepxError, match="keys are str"):
        await kv.get(7)  # type: ignore[arg-type]
    assert await kv.keys() == []


async def test_unicode_keys_and_fields(kv: KV) -> None:
    await kv.set("tensor:权重/ü", b"x")
    await kv.hset("tensor:权重/ü2", {"形状": "[2, 3]"})
    assert await kv.get("tensor:权重/ü") == b"x"
    assert await kv.hgetall("tensor:权重/ü2") == {"形状": "[2, 3]"}
    assert await kv.keys("tensor:权重*") == ["tensor:权重/ü", "tensor:权重/ü2"]


async def test_delete_counts_keys_of_every_type(kv: KV) -> None:
    await kv.set("s", b"1")
    await kv.hset("h", {"a": 1})
    await kv.rpush("l", b"x")
    assert await kv.delete("s", "h", "l", "missing", "s") == 3
    assert not any([await kv.exists("s"), await kv.exists("h"), await kv.exists("l")])
    assert await kv.delete("s") == 0
    assert await kv.delete() == 0
    assert await kv.keys() == []


async def test_keys_glob(kv: KV) -> None:
    names = ["tensor:a", "tensor:b1", "tensor:b2", "tensor:c*d", "tensor:", "node:1", "node:22", "ops:n1:cpu", "x[1]"]
    for name in names:
        await kv.set(name, b"")
    await kv.hset("tensor:h", {"f": "v"})
    await kv.rpush("tensor:l", b"v")
    assert await kv.keys() == sorted([*names, "tensor:h", "tensor:l"])
    assert await kv.keys("tensor:*") == [
        "tensor:",
        "tensor:a",
        "tensor:b1",
        "tensor:b2",
        "tensor:c*d",
        "tensor:h",
        "tensor:l",
    ]
    assert await kv.keys("tensor:b?") == ["tensor:b1", "tensor:b2"]
    assert await kv.keys("tensor:[ab]*") == ["tensor:a", "tensor:b1", "tensor:b2"]
    assert await kv.keys("tensor:[^ab]*") == ["tensor:c*d", "tensor:h", "tensor:l"]
    assert await kv.keys("tensor:[a-b]?") == ["tensor:b1", "tensor:b2"]
    assert await kv.keys("node:?") == ["node:1"]
    assert await kv.keys("ops:*:cpu") == ["ops:n1:cpu"]
    assert await kv.keys("tensor:c\\*d") == ["tensor:c*d"]
    assert await kv.keys("x\\[1\\]") == ["x[1]"]
    assert await kv.keys("nothing*") == []
    assert await kv.keys("tensor:a") == ["tensor:a"]


async def test_keys_sees_many(kv: KV) -> None:
    async with kv.batch() as b:
        for i in range(2500):
            b.set(f"tensor:{i:05d}", b"")
    found = await kv.keys("tensor:*")
    assert found == [f"tensor:{i:05d}" for i in range(2500)]
    assert await kv.keys("tensor:0001?") == [f"tensor:{i:05d}" for i in range(10, 20)]


# hashes


async def test_hash_values_are_strings(kv: KV) -> None:
    await kv.hset("tensor:w", {"dtype": "float32", "refcount": 1, "bytes": 4096, "ctime": 1.5, "handle": b"psm_1"})
    await kv.hset("tensor:w", {"shape": "[2, 3]", "refcount": 2})
    assert await kv.hgetall("tensor:w") == {
        "dtype": "float32",
        "refcount": "2",
        "bytes": "4096",
        "ctime": "1.5",
        "handle": "psm_1",
        "shape": "[2, 3]",
    }
    assert await kv.hget("tensor:w", "refcount") == "2"
    assert await kv.hget("tensor:w", "missing") is None
    assert await kv.hget("missing", "f") is None
    assert await kv.hgetall("missing") == {}
    await kv.hset("tensor:w", {})
    assert await kv.hget("tensor:w", "dtype") == "float32"


async def test_hash_values_must_be_text(kv: KV) -> None:
    with pytest.raises(DeepxError, match="UTF-8"):
        await kv.hset("h", {"f": b"\xff\xfe"})
    with pytest.raises(DeepxError, match="cannot store a list"):
        await kv.hset("h", {"f": [1]})  # type: ignore[dict-item]
    assert not await kv.exists("h")


async def test_hdel(kv: KV) -> None:
    await kv.hset("node:1", {"pid": 10, "roles": "all", "heartbeat": 1.0})
    assert await kv.hdel("node:1", "pid", "missing", "pid") == 1
    assert await kv.hgetall("node:1") == {"roles": "all", "heartbeat": "1.0"}
    assert await kv.hdel("node:1") == 0
    assert await kv.hdel("missing", "f") == 0
    assert await kv.hdel("node:1", "roles", "heartbeat") == 2
    assert not await kv.exists("node:1")  # an emptied hash is gone, as in Redis
    assert await kv.keys() == []


async def test_hincrby(kv: KV) -> None:
    assert await kv.hincrby("ops:n:cpu", "add.calls") == 1
    assert await kv.hincrby("ops:n:cpu", "add.calls", 41) == 42
    assert await kv.hincrby("ops:n:cpu", "add.calls", -50) == -8
    assert await kv.hget("ops:n:cpu", "add.calls") == "-8"
    await kv.hset("tensor:t", {"refcount": 3})
    assert await kv.hincrby("tensor:t", "refcount", -1) == 2
    await kv.hset("tensor:t", {"dtype": "f32", "big": 2**63 - 1})
    with pytest.raises(DeepxError, match="not an integer"):
        await kv.hincrby("tensor:t", "dtype")
    with pytest.raises(DeepxError, match="overflow"):
        await kv.hincrby("tensor:t", "big")
    with pytest.raises(DeepxError, match="int"):
        await kv.hincrby("tensor:t", "refcount", 1.5)  # type: ignore[arg-type]
    assert await kv.hget("tensor:t", "big") == str(2**63 - 1)


async def test_hincrbyfloat(kv: KV) -> None:
    assert await kv.hincrbyfloat("ops:n:cpu", "add.time", 1.5) == 1.5
    assert await kv.hincrbyfloat("ops:n:cpu", "add.time", 1.5) == 3.0
    assert await kv.hget("ops:n:cpu", "add.time") == "3"  # Redis writes integral results without a dot
    assert await kv.hincrbyfloat("ops:n:cpu", "add.time", -0.25) == 2.75
    assert await kv.hincrbyfloat("ops:n:cpu", "x", 0.1) == 0.1
    assert await kv.hincrbyfloat("ops:n:cpu", "x", 0.2) == pytest.approx(0.3)
    assert await kv.hget("ops:n:cpu", "x") == "0.3"
    assert await kv.hincrbyfloat("ops:n:cpu", "n", 2) == 2.0
    assert await kv.hincrby("ops:n:cpu", "n", 1) == 3  # "2" is an integer again
    assert await kv.hincrbyfloat("ops:n:cpu", "tiny", 1e-20) == 0.0  # Redis keeps 17 decimals
    assert await kv.hincrbyfloat("ops:n:cpu", "huge", 1e20) == 1e20
    assert await kv.hget("ops:n:cpu", "huge") == "100000000000000000000"
    await kv.hset("ops:n:cpu", {"name": "add"})
    with pytest.raises(DeepxError, match="not a float"):
        await kv.hincrbyfloat("ops:n:cpu", "name", 1.0)
    with pytest.raises(DeepxError, match="finite"):
        await kv.hincrbyfloat("ops:n:cpu", "x", float("nan"))


# lists


async def test_rpush_llen_lrange(kv: KV) -> None:
    assert await kv.llen("tensor_lifecycle") == 0
    assert await kv.lrange("tensor_lifecycle", 0, -1) == []
    assert await kv.rpush("tensor_lifecycle", b"a", b"b") == 2
    assert await kv.rpush("tensor_lifecycle", b"c") == 3
    assert await kv.rpush("tensor_lifecycle") == 3
    assert await kv.rpush("missing") == 0
    assert await kv.llen("tensor_lifecycle") == 3
    items = [b"a", b"b", b"c"]
    for start, stop in [
        (0, -1),
        (0, 0),
        (1, 2),
        (0, 99),
        (-1, -1),
        (-2, -1),
        (-99, 1),
        (2, 1),
        (3, 5),
        (-3, -2),
        (5, -1),
    ]:
        n = len(items)
        lo, hi = max(start + n if start < 0 else start, 0), stop + n if stop < 0 else stop
        assert await kv.lrange("tensor_lifecycle", start, stop) == items[lo : hi + 1], (start, stop)


async def test_wait_push_returns_once_items_can_be_popped(kv: KV) -> None:
    """A waiter for a list is back within its timeout once something is pushed (at once: both stores wake their
    waiters on a push), and at once when items already wait."""
    await kv.rpush("q", b"early")
    await asyncio.wait_for(kv.wait_push("q", 0.01), 5)
    assert await kv.lpop("q") == [b"early"]
    waiter = asyncio.ensure_future(kv.wait_push("q", 0.05))
    await asyncio.sleep(0)
    async with kv.batch() as b:
        b.rpush("q", b"late")
    await asyncio.wait_for(waiter, 5)
    assert await kv.lpop("q") == [b"late"]


async def test_a_long_wait_ends_at_the_push_and_takes_nothing(kv: KV) -> None:
    """A waiter with a long timeout returns when an item is pushed, not at its timeout; neither a wait nor a waiter
    cancelled mid-wait takes an item away or reorders the list."""
    assert kv.wakes_on_push
    waiter = asyncio.ensure_future(kv.wait_push("q", 30))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    started = time.monotonic()
    await kv.rpush("q", b"1", b"2")
    await asyncio.wait_for(waiter, 5)
    assert time.monotonic() - started < 5
    await kv.wait_push("q", 30)  # items wait: at once
    other = asyncio.ensure_future(kv.wait_push("empty", 30))
    await asyncio.sleep(0.05)
    other.cancel()
    await asyncio.gather(other, return_exceptions=True)
    assert await kv.lrange("q", 0, -1) == [b"1", b"2"]
    assert await kv.lpop("q", 5) == [b"1", b"2"]


async def test_missing_names_the_absent_keys_in_order(kv: KV) -> None:
    await kv.hset("tensor:a", {"node": "n1"})
    await kv.set("tensor:c", b"x")
    await kv.rpush("tensor:e", b"1")
    names = ["tensor:a", "tensor:b", "tensor:c", "tensor:d", "tensor:e"]
    assert await kv.missing(names) == ["tensor:b", "tensor:d"]
    assert await kv.missing([]) == []
    many = [f"k{i}" for i in range(2500)]  # more than one round of the pipeline
    async with kv.batch() as b:
        for k in many[::2]:
            b.set(k, b"1")
    assert await kv.missing(many) == many[1::2]


async def test_lpop_counts(kv: KV) -> None:
    assert await kv.lpop("q") == []
    assert await kv.lpop("q", 5) == []
    await kv.rpush("q", b"1", b"2", b"3", b"4", b"5")
    assert await kv.lpop("q") == [b"1"]
    assert await kv.lpop("q", 2) == [b"2", b"3"]
    assert await kv.lpop("q", 0) == []
    assert await kv.llen("q") == 2
    assert await kv.lpop("q", 10) == [b"4", b"5"]
    assert not await kv.exists("q")  # an emptied list is gone
    assert await kv.lpop("q") == []
    with pytest.raises(DeepxError, match="count"):
        await kv.lpop("q", -1)


# types


async def test_wrong_type_is_a_deepx_error(kv: KV) -> None:
    await kv.set("s", b"v")
    await kv.hset("h", {"f": "v"})
    await kv.rpush("l", b"v")
    calls = [
        lambda: kv.hset("s", {"f": 1}),
        lambda: kv.hget("s", "f"),
        lambda: kv.hgetall("l"),
        lambda: kv.hdel("s", "f"),
        lambda: kv.hincrby("l", "f"),
        lambda: kv.hincrbyfloat("s", "f", 1.0),
        lambda: kv.get("h"),
        lambda: kv.get("l"),
        lambda: kv.rpush("h", b"x"),
        lambda: kv.lpop("s"),
        lambda: kv.lrange("h", 0, -1),
        lambda: kv.llen("s"),
    ]
    for call in calls:
        with pytest.raises(DeepxError, match="WRONGTYPE"):
            await call()
    await kv.set("h", b"overwritten")  # set replaces a key of any type
    assert await kv.get("h") == b"overwritten"
    assert await kv.get("s") == b"v"


# batches


async def test_batch_applies_every_write(kv: KV) -> None:
    await kv.set("old", b"x")
    await kv.hset("tensor:b", {"refcount": 1, "gone": "y"})
    async with kv.batch() as b:
        b.set("graph:g", b"\x00prog")
        b.hset("tensor:a", {"dtype": "float32", "refcount": 1})
        b.hincrby("tensor:b", "refcount", 2)
        b.hincrby("tensor:b", "refcount", 2)
        b.hincrbyfloat("ops:n:cpu", "t", 0.5)
        b.hdel("tensor:b", "gone")
        b.rpush("tensor_lifecycle", b"create a", b"create b")
        b.delete("old")
        assert await kv.get("graph:g") is None  # nothing is sent before the block ends
    assert await kv.get("graph:g") == b"\x00prog"
    assert await kv.hgetall("tensor:a") == {"dtype": "float32", "refcount": "1"}
    assert await kv.hgetall("tensor:b") == {"refcount": "5"}
    assert await kv.hget("ops:n:cpu", "t") == "0.5"
    assert await kv.lrange("tensor_lifecycle", 0, -1) == [b"create a", b"create b"]
    assert not await kv.exists("old")


async def test_batch_sends_nothing_when_the_block_raises(kv: KV) -> None:
    await kv.set("keep", b"1")
    with pytest.raises(RuntimeError, match="boom"):
        async with kv.batch() as b:
            b.set("a", b"1")
            b.hset("h", {"f": 1})
            b.rpush("l", b"x")
            b.delete("keep")
            raise RuntimeError("boom")
    assert await kv.keys() == ["keep"]


async def test_batch_checks_arguments_when_called(kv: KV) -> None:
    b = kv.batch()
    with pytest.raises(DeepxError, match="bytes"):
        b.set("a", "text")  # type: ignore[arg-type]
    with pytest.raises(DeepxError, match="int"):
        b.hincrby("h", "f", 0.5)  # type: ignore[arg-type]
    b.set("ok", b"1")
    b.delete()
    b.hset("h", {})
    b.hdel("h")
    b.rpush("l")
    await b.execute()
    await b.execute()  # an executed batch is empty
    assert await kv.keys() == ["ok"]


async def test_batch_with_a_wrong_type_runs_the_others_and_raises(kv: KV) -> None:
    await kv.set("s", b"string")
    with pytest.raises(DeepxError, match=r"write 2 of 3 \(hset\).*WRONGTYPE"):
        async with kv.batch() as b:
            b.set("before", b"1")
            b.hset("s", {"f": 1})
            b.rpush("after", b"2")
    assert await kv.get("before") == b"1"
    assert await kv.lrange("after", 0, -1) == [b"2"]
    assert await kv.get("s") == b"string"


async def test_concurrent_increments_are_not_lost(kv: KV) -> None:
    await asyncio.gather(*(kv.hincrby("tensor:t", "refcount") for _ in range(200)))
    assert await kv.hget("tensor:t", "refcount") == "200"


# prefixes and lifecycle


async def test_prefix_isolation(kv: KV, tmp_path: Path) -> None:
    await kv.set("tensor:a", b"mine")
    await kv.hset("node:1", {"pid": 1})
    if kv.url == "memory":
        other = open_kv("memory", prefix="other:")  # each `memory` store is its own; nothing to share
    else:
        if kv.url.startswith("memory:"):
            await kv.close()  # one process holds a file at a time
        other = open_kv(kv.url, prefix=kv.prefix[:-1] + "-other:")
    async with other:
        assert await other.keys() == []
        assert await other.get("tensor:a") is None
        await other.set("tensor:a", b"theirs")
        await other.rpush("tensor_lifecycle", b"x")
        assert await other.delete("node:1") == 0
        assert await other.keys() == ["tensor:a", "tensor_lifecycle"]
    if kv.url.startswith("memory:"):
        await kv.connect()
    assert await kv.get("tensor:a") == b"mine"
    assert await kv.keys() == ["node:1", "tensor:a"]


async def test_a_store_must_be_connected(kv: KV) -> None:
    await kv.set("k", b"v")
    await kv.close()
    await kv.close()  # idempotent
    with pytest.raises(DeepxError, match="not connected"):
        await kv.get("k")
    with pytest.raises(DeepxError, match="not connected"):
        await kv.set("k", b"v")
    await kv.connect()
    await kv.connect()  # idempotent
    await kv.set("k", b"v2")
    assert await kv.get("k") == b"v2"


def test_open_kv_picks_the_backend() -> None:
    from deepxd.kv.memory import MemoryKV
    from deepxd.kv.redis import RedisKV

    assert isinstance(open_kv("memory"), MemoryKV)
    assert isinstance(open_kv("memory:///tmp/x.aof", prefix="p:"), MemoryKV)
    assert isinstance(open_kv("redis://127.0.0.1:1/0"), RedisKV)
    assert open_kv("redis://h:1/0", prefix="p:").prefix == "p:"
    with pytest.raises(DeepxError, match="unknown storage plane URL"):
        open_kv("postgres://x")
