"""The embedded store's file: replay, a torn tail, compaction, fsync policies, locking, and the errors operators see."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import struct
from pathlib import Path

import msgpack
import pytest

from deepx_core.errors import DeepxError
from deepxd.kv import memory
from deepxd.kv.memory import MAGIC, MemoryKV, read_records

EVERY_BYTE = bytes(range(256))


def url(path: Path, **query: str) -> str:
    return f"memory://{path}" + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")


def records(path: Path) -> list[list[list[object]]]:
    buf = path.read_bytes()
    assert buf.startswith(MAGIC)
    found, end, why = read_records(buf)
    assert (end, why) == (len(buf), "")
    return [effects for _, effects in found]


async def fill(kv: MemoryKV) -> None:
    await kv.set("graph:g", EVERY_BYTE)
    await kv.set("empty", b"")
    await kv.set("gone", b"x")
    await kv.delete("gone")
    await kv.hset("tensor:w", {"dtype": "float32", "refcount": 1, "shape": "[2, 3]"})
    await kv.hincrby("tensor:w", "refcount", 4)
    await kv.hincrbyfloat("ops:n:cpu", "add.time", 0.25)
    await kv.hset("node:1", {"pid": 1, "drop": "me"})
    await kv.hdel("node:1", "drop")
    await kv.rpush("tensor_lifecycle", b"a", b"b", b"c", EVERY_BYTE)
    await kv.lpop("tensor_lifecycle")
    async with kv.batch() as b:
        b.set("batch:s", b"1")
        b.hincrby("tensor:w", "refcount", 1)
        b.rpush("tensor_lifecycle", b"d")


async def check_filled(kv: MemoryKV, *more: str) -> None:
    names = ["batch:s", "empty", "graph:g", "node:1", "ops:n:cpu", "tensor:w", "tensor_lifecycle"]
    assert await kv.keys() == sorted([*names, *more])
    assert await kv.get("graph:g") == EVERY_BYTE
    assert await kv.get("empty") == b""
    assert await kv.hgetall("tensor:w") == {"dtype": "float32", "refcount": "6", "shape": "[2, 3]"}
    assert await kv.hgetall("ops:n:cpu") == {"add.time": "0.25"}
    assert await kv.hgetall("node:1") == {"pid": "1"}
    assert await kv.lrange("tensor_lifecycle", 0, -1) == [b"b", b"c", EVERY_BYTE, b"d"]
    assert await kv.get("batch:s") == b"1"


# replay


@pytest.mark.parametrize("fsync", ["always", "everysec", "no"])
async def test_reopen_restores_every_key(tmp_path: Path, fsync: str) -> None:
    path = tmp_path / "state" / "kv.aof"  # the folder is created
    async with MemoryKV(url(path), fsync=fsync) as kv:
        await fill(kv)
        await check_filled(kv)
    async with MemoryKV(url(path), fsync=fsync) as kv:
        await check_filled(kv)
        await kv.set("more", b"m")
    async with MemoryKV(url(path, fsync=fsync)) as kv:
        await check_filled(kv, "more")
        assert await kv.get("more") == b"m"


async def test_writes_reach_the_os_at_once(tmp_path: Path) -> None:
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path), fsync="no") as kv:
        await kv.set("a", b"1")
        await kv.hincrby("h", "n", 2)
        await kv.lpop("missing")  # no effect, no record
        assert records(path) == [[["set", "deepx:a", b"1"]], [["hset", "deepx:h", {"n": "2"}]]]


async def test_a_batch_is_one_record(tmp_path: Path) -> None:
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path)) as kv:
        await kv.set("before", b"0")
        async with kv.batch() as b:
            b.set("a", b"1")
            b.hset("h", {"f": "v"})
            b.rpush("l", b"x", b"y")
            b.delete("before", "missing")
        assert len(records(path)) == 2
        assert records(path)[1] == [
            ["set", "deepx:a", b"1"],
            ["hset", "deepx:h", {"f": "v"}],
            ["rpush", "deepx:l", [b"x", b"y"]],
            ["del", "deepx:before"],
        ]
    with path.open("r+b") as f:  # a crash in the middle of the batch's record loses all of the batch
        f.truncate(path.stat().st_size - 3)
    async with MemoryKV(url(path)) as kv:
        assert await kv.keys() == ["before"]


def chop(path: Path, n: int) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - n)


@pytest.mark.parametrize("cut", [1, 5, 8, 9, 20])
async def test_a_torn_tail_is_dropped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: int
) -> None:
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path)) as kv:
        for i in range(10):
            await kv.set(f"k{i}", b"v" * 20)
        good = path.stat().st_size
        await kv.set("last", b"w" * 20)  # a record of 8 + 32 bytes
    chop(path, cut)
    with caplog.at_level(logging.WARNING, logger="deepxd.kv.memory"):
        async with MemoryKV(url(path)) as kv:
            assert await kv.keys() == [f"k{i}" for i in range(10)]
            assert path.stat().st_size == good  # truncated to the last good record
            await kv.set("after", b"a")
    assert any("dropped" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    async with MemoryKV(url(path)) as kv:
        assert await kv.get("after") == b"a"
        assert len(await kv.keys()) == 11


@pytest.mark.parametrize(
    "tail",
    [b"\x00" * 64, b"\xff" * 3, struct.pack("<II", 4, 0) + b"abcd", struct.pack("<II", 1, 0xFFFFFFFF)],
    ids=["zeros", "garbage", "bad-checksum", "too-long"],
)
async def test_a_corrupt_tail_is_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture, tail: bytes) -> None:
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path)) as kv:
        await kv.hset("h", {"f": "v"})
    good = path.stat().st_size
    with path.open("ab") as f:
        f.write(tail)
    with caplog.at_level(logging.WARNING, logger="deepxd.kv.memory"):
        async with MemoryKV(url(path)) as kv:
            assert await kv.hgetall("h") == {"f": "v"}
    assert path.stat().st_size == good
    assert "dropped" in caplog.text


async def test_one_flipped_bit_in_a_valid_record_is_caught_by_its_checksum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record whose payload still decodes to valid effects after one bit flipped (a value byte 'w' -> 'v'): only
    the checksum tells, and the record is dropped rather than replayed with the wrong value."""
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path)) as kv:
        await kv.set("k", b"v")
        good = path.stat().st_size
        await kv.set("last", b"w" * 20)
    data = bytearray(path.read_bytes())
    at = data.index(b"w" * 20, good)
    data[at] ^= 0x01
    flipped = msgpack.unpackb(bytes(data[good + 8 :]), raw=False)
    assert flipped[0][0] == "set" and flipped[0][2] == b"v" + b"w" * 19  # still a valid record
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="deepxd.kv.memory"):
        async with MemoryKV(url(path)) as kv:
            assert await kv.keys() == ["k"]
    assert path.stat().st_size == good
    assert "checksum does not match" in caplog.text


async def test_an_empty_or_half_created_file_starts_empty(tmp_path: Path) -> None:
    for content in [b"", MAGIC[:3]]:
        path = tmp_path / "kv.aof"
        path.write_bytes(content)
        async with MemoryKV(url(path)) as kv:
            assert await kv.keys() == []
            await kv.set("a", b"1")
        assert path.read_bytes().startswith(MAGIC)


async def test_a_foreign_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"important notes, not a store\n")
    with pytest.raises(DeepxError, match=f"{path} is not a deepx storage file"):
        await MemoryKV(url(path)).connect()
    assert path.read_bytes() == b"important notes, not a store\n"


async def test_a_record_that_does_not_apply_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kv.aof"
    payload = msgpack.packb([["hdel", "deepx:missing", ["f"]]])
    path.write_bytes(MAGIC + struct.pack("<II", len(payload), __import__("zlib").crc32(payload)) + payload)
    with pytest.raises(DeepxError, match="does not apply"):
        await MemoryKV(url(path)).connect()


# compaction


async def test_compaction_at_connect_shrinks_the_file_and_keeps_the_data(tmp_path: Path) -> None:
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path), fsync="no", compact_min_bytes=1 << 30) as kv:
        for i in range(2000):
            await kv.hset("node:1", {"heartbeat": i, "pid": 7})
            await kv.set("graph:g", EVERY_BYTE + str(i).encode())
        await kv.rpush("tensor_lifecycle", *(b"x%d" % i for i in range(100)))
        await kv.lpop("tensor_lifecycle", 60)
        await kv.set("tmp", b"t")
        await kv.delete("tmp")
    grown = path.stat().st_size
    assert grown > 500_000
    (tmp_path / "kv.aof.rewrite").write_bytes(b"left by a crash during a rewrite")
    async with MemoryKV(url(path)) as kv:
        assert await kv.hgetall("node:1") == {"heartbeat": "1999", "pid": "7"}
        assert await kv.get("graph:g") == EVERY_BYTE + b"1999"
        assert await kv.lrange("tensor_lifecycle", 0, -1) == [b"x%d" % i for i in range(60, 100)]
        assert not await kv.exists("tmp")
    assert path.stat().st_size < 1000
    assert len(records(path)) == 3  # one record per live key
    assert not (tmp_path / "kv.aof.rewrite").exists()
    async with MemoryKV(url(path)) as kv:
        assert await kv.hget("node:1", "heartbeat") == "1999"


async def test_a_failed_compaction_keeps_the_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path), compact_min_bytes=1 << 30) as kv:
        for i in range(300):
            await kv.hset("node:1", {"heartbeat": i})
    grown = path.stat().st_size
    (tmp_path / "kv.aof.rewrite").mkdir()  # the rewrite cannot be created
    async with MemoryKV(url(path), compact_min_bytes=1) as kv:
        assert await kv.hget("node:1", "heartbeat") == "299"
        for i in range(300, 700):
            await kv.hset("node:1", {"heartbeat": i})  # a compaction while running fails the same way
            await asyncio.sleep(0)
    # once at start, once when the file had doubled; not at every write
    assert caplog.text.count("compaction failed, the file is kept as it is") == 2
    assert path.stat().st_size > 2 * grown
    async with MemoryKV(url(path)) as kv:
        assert await kv.hget("node:1", "heartbeat") == "699"


async def test_a_compact_file_is_not_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path)) as kv:
        for i in range(50):
            await kv.set(f"k{i}", b"v")
    before = path.stat()
    async with MemoryKV(url(path)) as kv:
        assert len(await kv.keys()) == 50
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("fsync", ["always", "everysec"])
async def test_compaction_while_running_keeps_concurrent_writes(
    tmp_path: Path, fsync: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "kv.aof"
    caplog.set_level(logging.INFO, logger="deepxd.kv.memory")
    async with MemoryKV(url(path), fsync=fsync, compact_min_bytes=20_000) as kv:

        async def writer(w: int, wave: int) -> None:
            for i in range(wave * 30, wave * 30 + 30):
                await kv.hset(f"node:{w}", {"heartbeat": i, "pad": "p" * 50})
                await kv.rpush(f"log:{w}", b"%d" % i)
                await asyncio.sleep(0)

        appended = path.stat().st_size
        for wave in range(10):  # each wave appends about 14 kB, while compactions run in threads
            await asyncio.gather(*(writer(w, wave) for w in range(4)))
            await asyncio.sleep(0.02)
            appended += 4 * 30 * 115
        assert caplog.text.count("compacted to") >= 2  # rewritten while running, more than once
        assert path.stat().st_size < appended / 2
    async with MemoryKV(url(path)) as kv:
        for w in range(4):
            assert await kv.hget(f"node:{w}", "heartbeat") == "299"
            assert await kv.lrange(f"log:{w}", 0, -1) == [b"%d" % i for i in range(300)]


# fsync policies


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return calls


async def test_fsync_always_syncs_every_write(tmp_path: Path, fsyncs: list[int]) -> None:
    async with MemoryKV(url(tmp_path / "kv.aof"), fsync="always") as kv:
        fsyncs.clear()
        for i in range(5):
            await kv.set(f"k{i}", b"v")
        async with kv.batch() as b:
            b.set("a", b"1")
            b.set("b", b"2")
        assert len(fsyncs) == 6
        await kv.get("k1")
        await kv.lpop("missing")
        assert len(fsyncs) == 6  # reads and no-op writes do not sync
        await asyncio.gather(*(kv.hincrby("h", "n") for _ in range(50)))
        assert len(fsyncs) < 56  # concurrent writers share fsyncs


async def test_fsync_everysec_syncs_in_the_background_and_at_close(tmp_path: Path, fsyncs: list[int]) -> None:
    kv = MemoryKV(url(tmp_path / "kv.aof"))
    assert kv.fsync == "everysec"
    async with kv:
        fsyncs.clear()
        for i in range(20):
            await kv.set(f"k{i}", b"v")
        assert fsyncs == []
        # the background sync, a second after the start (a fixed 1.3 s took its fsync, on a thread, to have begun
        # by then: a loaded machine need not have started that thread)
        deadline = asyncio.get_running_loop().time() + 60
        while not fsyncs and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert len(fsyncs) == 1
        await asyncio.sleep(1.1)
        assert len(fsyncs) == 1  # nothing new to sync
        await kv.set("late", b"v")
    assert len(fsyncs) == 2


async def test_fsync_no_leaves_it_to_the_os(tmp_path: Path, fsyncs: list[int]) -> None:
    async with MemoryKV(url(tmp_path / "kv.aof"), fsync="no") as kv:
        fsyncs.clear()
        for i in range(20):
            await kv.set(f"k{i}", b"v")
    assert fsyncs == []
    async with MemoryKV(url(tmp_path / "kv.aof")) as kv:
        assert len(await kv.keys()) == 20


def test_a_bad_fsync_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DeepxError, match="fsync policy 'sometimes' is not one of always, everysec, no"):
        MemoryKV(url(tmp_path / "kv.aof"), fsync="sometimes")
    with pytest.raises(DeepxError, match="fsync policy"):
        MemoryKV(url(tmp_path / "kv.aof", fsync="1"))
    with pytest.raises(DeepxError, match="fsync policy"):
        MemoryKV("memory", fsync="never")
    with pytest.raises(DeepxError, match="unknown option"):
        MemoryKV(url(tmp_path / "kv.aof", mode="x"))
    assert MemoryKV(url(tmp_path / "kv.aof", fsync="always")).fsync == "always"


# errors an operator meets


@pytest.mark.parametrize(
    "bad",
    ["memory://host/kv.aof", "memory:relative/kv.aof", "memory:///tmp/folder/"],
    ids=["host", "relative", "folder"],
)
def test_bad_urls_say_how_to_write_them(bad: str) -> None:
    with pytest.raises(DeepxError, match=r"memory:///abs/path/file"):
        MemoryKV(bad)


@pytest.mark.parametrize("ok", ["memory", "memory:", "memory://"])
async def test_urls_for_a_store_without_a_file(ok: str) -> None:
    kv = MemoryKV(ok)
    assert kv.path is None
    async with kv:
        await kv.set("a", b"1")
        assert await kv.get("a") == b"1"


async def test_an_unwritable_path_names_the_path_and_the_reason(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(
        DeepxError, match=rf"cannot open the storage file {blocker}/kv.aof: (File exists|Not a directory)"
    ):
        await MemoryKV(url(blocker / "kv.aof")).connect()
    folder = tmp_path / "a-folder"
    folder.mkdir()
    with pytest.raises(DeepxError, match=rf"cannot open the storage file {folder}: Is a directory"):
        await MemoryKV(f"memory://{folder}").connect()


async def test_one_process_at_a_time_holds_a_file(tmp_path: Path) -> None:
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path)) as kv:
        with pytest.raises(DeepxError, match="in use by another process"):
            await MemoryKV(url(path)).connect()
        await kv.set("a", b"1")
    async with MemoryKV(url(path)) as kv:  # free again once closed
        assert await kv.get("a") == b"1"


async def test_a_failed_write_refuses_later_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path)) as kv:
        await kv.set("a", b"1")

        def full(fd: int, data: object) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        with monkeypatch.context() as m:
            m.setattr(memory.os, "write", full)
            with pytest.raises(DeepxError, match="No space left on device"):
                await kv.set("b", b"2")
        assert await kv.get("b") is None  # not applied, since it was not logged
        with pytest.raises(DeepxError, match="refused until the daemon is restarted"):
            await kv.set("c", b"3")
        with pytest.raises(DeepxError, match="refused"):
            async with kv.batch() as b:
                b.set("d", b"4")
        assert await kv.get("a") == b"1"  # reads still work
    async with MemoryKV(url(path)) as kv:
        assert await kv.keys() == ["a"]


async def test_the_prefix_is_part_of_the_stored_key(tmp_path: Path) -> None:
    path = tmp_path / "kv.aof"
    async with MemoryKV(url(path), prefix="a:") as kv:
        await kv.set("k", b"A")
    async with MemoryKV(url(path), prefix="b:") as kv:
        assert await kv.keys() == []
        await kv.set("k", b"B")
    async with MemoryKV(url(path), prefix="a:") as kv:
        assert await kv.get("k") == b"A"
    assert [r[0][1] for r in records(path)] == ["a:k", "b:k"]


async def test_wait_push_sleeps_until_a_push_to_its_list() -> None:
    """The embedded store sees every push: heapmem's lifecycle poll waits on it instead of ticking, so an idle
    embedded daemon's loop sleeps. A push to another list, or another write, does not wake it."""
    async with MemoryKV() as kv:
        waiter = asyncio.ensure_future(kv.wait_push("tensor_lifecycle", 0.001))
        await asyncio.sleep(0.05)  # far past the timeout a poll would have used
        assert not waiter.done()
        await kv.rpush("other", b"x")
        await kv.set("tensor_lifecycle:not-the-list", b"y")
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await kv.rpush("tensor_lifecycle", b"cmd")
        await asyncio.wait_for(waiter, 1)
        # two waiters on one list both wake; one that comes while items wait does not sleep at all
        waiters = [asyncio.ensure_future(kv.wait_push("l2", 1)) for _ in range(2)]
        await asyncio.sleep(0)
        async with kv.batch() as b:
            b.rpush("l2", b"a")
        await asyncio.wait_for(asyncio.gather(*waiters), 1)
        await asyncio.wait_for(kv.wait_push("l2", 1), 0.5)
        assert await kv.lpop("l2") == [b"a"]


async def test_wait_push_on_a_key_that_is_not_a_list_paces_like_a_poll() -> None:
    async with MemoryKV() as kv:
        await kv.set("tensor_lifecycle", b"a string")
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(kv.wait_push("tensor_lifecycle", 0.05), 1)
        assert asyncio.get_running_loop().time() - t0 >= 0.04
