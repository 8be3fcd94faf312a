"""The embedded storage plane: every key in a dict in this process, optionally persisted to an append-only file.

`memory` keeps everything in memory; `memory:///abs/path/file` (optionally `?fsync=always|everysec|no`) also appends
every write to the file and replays it on connect. The file is `MAGIC` then records, each a little-endian u32 payload
length, a u32 CRC-32 of the payload and the payload: a msgpack array of effects, where an effect is one of

    ["set", key, bytes]  ["del", key]  ["hset", key, {field: str}]  ["hdel", key, [field, ...]]
    ["rpush", key, [bytes, ...]]  ["lpop", key, count]

Keys are stored with their prefix. A write is logged as its effect (hincrby as the hset of the new value), so replay
needs no arithmetic; a batch is one record, so a crash keeps all of it or none. See docs/storage.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import struct
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, localcontext
from itertools import islice
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import msgpack

from deepx_core.errors import DeepxError
from deepxd.kv.base import (
    INT64_MAX,
    INT64_MIN,
    KV,
    HashValue,
    QueuedBatch,
    as_bytes,
    check_count,
    check_field,
    check_float,
    check_int,
    check_key,
    compile_glob,
    hash_mapping,
    wrong_type,
)

log = logging.getLogger(__name__)

MAGIC = b"DEEPXKV1"
HEADER = struct.Struct("<II")  # payload length, CRC-32 of the payload
FSYNC_POLICIES = ("always", "everysec", "no")
COMPACT_MIN_BYTES = 1 << 20  # a running store rewrites its file once it is past this and twice the compact size

Value = bytes | dict[str, str] | deque[bytes]
Effect = list[Any]

_TYPE_NAMES: dict[type, str] = {bytes: "a string", dict: "a hash", deque: "a list"}
_INT_TEXT = re.compile(r"0|-?[1-9][0-9]{0,19}")  # what Redis's string2ll accepts
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_FLOAT_MAX = Decimal("1.7976931348623157e308")


class MemoryKV(KV):
    """The embedded store; persisted to an append-only file when the URL names one (see the module docstring)."""

    def __init__(
        self,
        url: str = "memory",
        prefix: str = "deepx:",
        fsync: str = "everysec",
        compact_min_bytes: int = COMPACT_MIN_BYTES,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.path, self.fsync = _parse_url(url, fsync)
        self.compact_min_bytes = compact_min_bytes
        self._data: dict[str, Value] = {}
        self._file: AppendOnlyFile | None = None
        self._open = False
        self._pushed: dict[str, asyncio.Event] = {}  # full key -> set by a push to it (wait_push's waiters)

    async def connect(self) -> None:
        if self._open:
            return
        if self.path is not None:
            self._data.clear()
            file = AppendOnlyFile(self.path, self.fsync, self._data, self.compact_min_bytes)
            await asyncio.to_thread(file.load)
            file.start()
            self._file = file
        self._open = True

    async def close(self) -> None:
        if not self._open:
            return
        self._open = False
        file, self._file = self._file, None
        if file is not None:
            await file.close()

    # reads

    async def get(self, key: str) -> bytes | None:
        return self._read("get", key, bytes)

    async def exists(self, key: str) -> bool:
        self._check_open()
        return self.prefix + check_key(key) in self._data

    async def missing(self, keys: Sequence[str]) -> list[str]:
        self._check_open()
        return [k for k in keys if self.prefix + check_key(k) not in self._data]

    async def keys(self, pattern: str = "*") -> list[str]:
        self._check_open()
        match, n = compile_glob(pattern).fullmatch, len(self.prefix)
        return sorted(
            k[n:] for k in self._data if k.startswith(self.prefix) and match(k[n:].encode("utf-8", "surrogatepass"))
        )

    async def hget(self, key: str, field: str) -> str | None:
        h = self._read("hget", key, dict)
        return None if h is None else h.get(check_field(field))

    async def hgetall(self, key: str) -> dict[str, str]:
        h = self._read("hgetall", key, dict)
        return {} if h is None else dict(h)

    async def lrange(self, key: str, start: int, stop: int) -> list[bytes]:
        items = self._read("lrange", key, deque)
        if items is None:
            return []
        n = len(items)
        start, stop = max(start + n if start < 0 else start, 0), min(stop + n if stop < 0 else stop, n - 1)
        return list(islice(items, start, stop + 1)) if start <= stop else []

    async def llen(self, key: str) -> int:
        items = self._read("llen", key, deque)
        return 0 if items is None else len(items)

    wakes_on_push = True

    async def wait_push(self, key: str, timeout: float) -> None:
        """Every push to this store is made here, on this loop: wait for one (however long) unless items wait."""
        self._check_open()
        full = self.prefix + check_key(key)
        event = self._pushed.get(full)
        if event is None:
            event = self._pushed[full] = asyncio.Event()
        held = self._data.get(full)
        if held is None or (type(held) is deque and not held):
            event.clear()
            await event.wait()
        elif type(held) is not deque:  # not a list: lpop refuses it; a poll's pace, not a spin
            await asyncio.sleep(timeout)

    def _apply(self, effects: list[Effect]) -> None:
        data, pushed = self._data, self._pushed
        for effect in effects:
            apply_effect(data, effect)
            if pushed and effect[0] == "rpush":
                event = pushed.get(effect[1])
                if event is not None:
                    event.set()

    # writes: each builds the same op tuple a batch queues

    async def set(self, key: str, value: bytes) -> None:
        await self._write(("set", check_key(key), as_bytes(value, "set")))

    async def set_if_absent(self, key: str, value: bytes) -> bool:
        result: bool = await self._write(("set_nx", check_key(key), as_bytes(value, "set_if_absent")))
        return result

    async def delete(self, *keys: str) -> int:
        if not keys:
            return 0
        result: int = await self._write(("delete", tuple(check_key(k) for k in keys)))
        return result

    async def hset(self, key: str, mapping: Mapping[str, HashValue]) -> None:
        fields = hash_mapping(mapping)
        if fields:
            await self._write(("hset", check_key(key), fields))
        else:
            self._check_open()

    async def hdel(self, key: str, *fields: str) -> int:
        if not fields:
            self._check_open()
            return 0
        result: int = await self._write(("hdel", check_key(key), tuple(check_field(f) for f in fields)))
        return result

    async def hincrby(self, key: str, field: str, amount: int = 1) -> int:
        op = ("hincrby", check_key(key), check_field(field), check_int(amount, "hincrby"))
        result: int = await self._write(op)
        return result

    async def hincrbyfloat(self, key: str, field: str, amount: float) -> float:
        op = ("hincrbyfloat", check_key(key), check_field(field), check_float(amount, "hincrbyfloat"))
        result: float = await self._write(op)
        return result

    async def rpush(self, key: str, *values: bytes) -> int:
        result: int = await self._write(("rpush", check_key(key), tuple(as_bytes(v, "rpush") for v in values)))
        return result

    async def lpop(self, key: str, count: int = 1) -> list[bytes]:
        result: list[bytes] = await self._write(("lpop", check_key(key), check_count(count)))
        return result

    def batch(self) -> MemoryBatch:
        return MemoryBatch(self)

    # internals

    def _check_open(self) -> None:
        if not self._open:
            raise DeepxError(f"the storage plane {self.url} is not connected: call connect() (or use `async with`)")

    def _read(self, op: str, key: str, kind: type) -> Any:
        self._check_open()
        return self._held(op, check_key(key), kind)

    async def _write(self, op: tuple[Any, ...]) -> Any:
        """Plan the op's effects against the current state, log them, then apply them (all without yielding)."""
        self._check_open()
        effects, result = self._plan(op)
        if effects:
            if self._file is not None:
                self._file.append(effects)
            self._apply(effects)
            if self._file is not None and self.fsync == "always":
                await self._file.sync()
        return result

    async def _execute(self, ops: list[tuple[Any, ...]]) -> None:
        self._check_open()
        if self._file is not None:
            self._file.check_writable()
        done: list[Effect] = []
        failed: tuple[int, tuple[Any, ...], DeepxError] | None = None
        for i, op in enumerate(ops):
            try:
                effects, _ = self._plan(op)
            except DeepxError as error:
                failed = failed or (i, op, error)
                continue
            self._apply(effects)
            done += effects
        if done and self._file is not None:
            self._file.append(done)
            if self.fsync == "always":
                await self._file.sync()
        if failed is not None:
            i, op, e = failed
            raise DeepxError(f"batch: write {i + 1} of {len(ops)} ({op[0]}) failed, the others were applied: {e}")

    def _plan(self, op: tuple[Any, ...]) -> tuple[list[Effect], Any]:
        planner: Callable[..., tuple[list[Effect], Any]] = getattr(self, "_plan_" + op[0])
        return planner(*op[1:])

    def _held(self, op: str, key: str, kind: type) -> Any:
        value = self._data.get(self.prefix + key)
        if value is None or type(value) is kind:
            return value
        raise wrong_type(op, key, _TYPE_NAMES[kind][2:], _TYPE_NAMES[type(value)])

    def _plan_set(self, key: str, value: bytes) -> tuple[list[Effect], Any]:
        return [["set", self.prefix + key, value]], None

    def _plan_set_nx(self, key: str, value: bytes) -> tuple[list[Effect], Any]:
        if self.prefix + key in self._data:
            return [], False
        return [["set", self.prefix + key, value]], True

    def _plan_delete(self, keys: tuple[str, ...]) -> tuple[list[Effect], Any]:
        gone = [k for k in dict.fromkeys(self.prefix + k for k in keys) if k in self._data]
        return [["del", k] for k in gone], len(gone)

    def _plan_hset(self, key: str, fields: dict[str, str]) -> tuple[list[Effect], Any]:
        self._held("hset", key, dict)
        return [["hset", self.prefix + key, fields]], None

    def _plan_hdel(self, key: str, fields: tuple[str, ...]) -> tuple[list[Effect], Any]:
        h = self._held("hdel", key, dict) or {}
        gone = [f for f in dict.fromkeys(fields) if f in h]
        return ([["hdel", self.prefix + key, gone]] if gone else []), len(gone)

    def _plan_hincrby(self, key: str, field: str, amount: int) -> tuple[list[Effect], Any]:
        text = (self._held("hincrby", key, dict) or {}).get(field, "0")
        if not _INT_TEXT.fullmatch(text) or not INT64_MIN <= int(text) <= INT64_MAX:
            raise DeepxError(f"hincrby {key!r} {field!r}: the hash value {text!r} is not an integer")
        value = int(text) + amount
        if not INT64_MIN <= value <= INT64_MAX:
            raise DeepxError(f"hincrby {key!r} {field!r}: increment or decrement would overflow 64 bits")
        return [["hset", self.prefix + key, {field: str(value)}]], value

    def _plan_hincrbyfloat(self, key: str, field: str, amount: float) -> tuple[list[Effect], Any]:
        text = (self._held("hincrbyfloat", key, dict) or {}).get(field, "0")
        if not _FLOAT_TEXT.fullmatch(text) or abs(Decimal(text)) > _FLOAT_MAX:
            raise DeepxError(f"hincrbyfloat {key!r} {field!r}: the hash value {text!r} is not a float")
        total = Decimal(text) + Decimal(repr(amount))  # exact, as Redis's long double nearly is
        if abs(total) > _FLOAT_MAX:
            raise DeepxError(f"hincrbyfloat {key!r} {field!r}: increment would produce NaN or Infinity")
        stored = redis_float_text(total)
        return [["hset", self.prefix + key, {field: stored}]], float(stored)

    def _plan_rpush(self, key: str, values: tuple[bytes, ...]) -> tuple[list[Effect], Any]:
        items = self._held("rpush", key, deque)
        n = 0 if items is None else len(items)
        return ([["rpush", self.prefix + key, list(values)]] if values else []), n + len(values)

    def _plan_lpop(self, key: str, count: int) -> tuple[list[Effect], Any]:
        items = self._held("lpop", key, deque)
        popped = [] if items is None else list(islice(items, count))
        return ([["lpop", self.prefix + key, len(popped)]] if popped else []), popped


class MemoryBatch(QueuedBatch):
    def __init__(self, kv: MemoryKV) -> None:
        super().__init__()
        self._kv = kv

    async def execute(self) -> None:
        ops, self.ops = self.ops, []
        if ops:
            await self._kv._execute(ops)


def apply_effect(data: dict[str, Value], effect: Effect) -> None:
    """Apply one logged effect; ValueError/TypeError on one that does not fit (only from a foreign or edited file)."""
    kind, key = effect[0], effect[1]
    if not isinstance(key, str):
        raise TypeError(f"key {key!r} is not a str")
    held = data.get(key)
    if kind == "set":
        if not isinstance(effect[2], bytes):
            raise TypeError("set value is not bytes")
        data[key] = effect[2]
    elif kind == "del":
        data.pop(key, None)
    elif kind == "hset":
        fields = effect[2]
        if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
            raise TypeError("hset fields are not a map of str")
        if held is None:
            data[key] = dict(fields)
        elif isinstance(held, dict):
            held.update(fields)
        else:
            raise ValueError(f"hset on {_TYPE_NAMES[type(held)]}")
    elif kind == "hdel":
        if not isinstance(held, dict):
            raise ValueError("hdel on a missing key or a non-hash")
        for f in effect[2]:
            held.pop(f, None)
        if not held:
            del data[key]
    elif kind == "rpush":
        values = effect[2]
        if not isinstance(values, list) or not all(isinstance(v, bytes) for v in values):
            raise TypeError("rpush values are not a list of bytes")
        if held is None:
            data[key] = deque(values)
        elif isinstance(held, deque):
            held.extend(values)
        else:
            raise ValueError(f"rpush on {_TYPE_NAMES[type(held)]}")
    elif kind == "lpop":
        if not isinstance(held, deque) or not isinstance(effect[2], int) or not 0 < effect[2] <= len(held):
            raise ValueError("lpop past the end of the list")
        for _ in range(effect[2]):
            held.popleft()
        if not held:
            del data[key]
    else:
        raise ValueError(f"unknown effect {kind!r}")


def redis_float_text(value: Decimal) -> str:
    """A HINCRBYFLOAT result as Redis stores it: `%.17Lf` with trailing zeros (and the dot) removed."""
    with localcontext() as ctx:
        ctx.prec = 400
        text = format(value.quantize(Decimal("1e-17")), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def frame(effects: list[Effect]) -> bytes:
    payload = msgpack.packb(effects, use_bin_type=True)
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def compact_image(data: dict[str, Value]) -> bytes:
    """The whole store as a file: MAGIC, then one record per live key."""
    parts = [MAGIC]
    for key, value in data.items():
        if isinstance(value, bytes):
            parts.append(frame([["set", key, value]]))
        elif isinstance(value, dict):
            parts.append(frame([["hset", key, value]]))
        else:
            parts.append(frame([["rpush", key, list(value)]]))
    return b"".join(parts)


def read_records(buf: bytes, start: int = len(MAGIC)) -> tuple[list[tuple[int, list[Effect]]], int, str]:
    """The records of a file image as (offset, effects), the offset where good records end and why they end there
    ("" at the end of the file)."""
    records: list[tuple[int, list[Effect]]] = []
    pos = start
    while pos < len(buf):
        if pos + HEADER.size > len(buf):
            return records, pos, "a truncated record header"
        length, crc = HEADER.unpack_from(buf, pos)
        end = pos + HEADER.size + length
        if end > len(buf):
            return records, pos, "a truncated record"
        payload = buf[pos + HEADER.size : end]
        if zlib.crc32(payload) != crc:
            return records, pos, "a record whose checksum does not match"
        try:
            effects = msgpack.unpackb(payload, raw=False)
        except Exception:
            return records, pos, "a record that does not decode"
        if not isinstance(effects, list) or not all(isinstance(e, list) and len(e) >= 2 for e in effects):
            return records, pos, "a record that is not a list of effects"
        records.append((pos, effects))
        pos = end
    return records, pos, ""


class AppendOnlyFile:
    """The file behind a persisted MemoryKV: load (replay, repair, compact), append, fsync by policy, compact."""

    def __init__(self, path: str, fsync: str, data: dict[str, Value], compact_min_bytes: int) -> None:
        self.path = path
        self.fsync = fsync
        self.data = data
        self.compact_min_bytes = compact_min_bytes
        self.fd = -1
        self.size = 0  # bytes in the file
        self.compact_size = 0  # bytes the file had after its last rewrite (or would have, compacted, at load)
        self.written = 0  # records appended, and how many of them are known to be on disk
        self.synced = 0
        self.failed = ""  # why the file cannot be written any more
        self._pending: list[bytes] | None = None  # records appended while a compaction runs
        self._sync_lock = asyncio.Lock()
        self._syncer: asyncio.Task[None] | None = None
        self._compaction: asyncio.Task[None] | None = None

    # load, in a thread, before the store is used

    def load(self) -> None:
        folder = os.path.dirname(self.path)
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise DeepxError(f"cannot open the storage file {self.path}: {e.strerror or e}") from None
        try:
            _lock(fd, self.path)
            self._replay(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        with contextlib.suppress(OSError):
            os.unlink(self.path + ".rewrite")  # left by a crash during a rewrite
        image = compact_image(self.data)
        self.compact_size = len(image)
        if self.size > 2 * len(image):
            log.info("%s: rewriting %d bytes as %d (one record per key)", self.path, self.size, len(image))
            tmp = -1
            try:
                tmp = self._create_rewrite()
                _write_all(tmp, image)
                os.fsync(tmp)
                os.close(self._install(tmp, len(image)))
                _fsync_dir(folder)
            except (OSError, DeepxError) as e:  # a full disk: go on with the file as it is
                log.error("%s: compaction failed, the file is kept as it is: %s", self.path, e)
                self.compact_size = self.size  # the next try waits until the file has doubled
                if tmp >= 0 and tmp != self.fd:
                    os.close(tmp)
                    with contextlib.suppress(OSError):
                        os.unlink(self.path + ".rewrite")

    def _replay(self, fd: int) -> None:
        with os.fdopen(os.dup(fd), "rb") as f:
            buf = f.read()
        if len(buf) < len(MAGIC) and MAGIC.startswith(buf):
            os.ftruncate(fd, 0)
            _write_all(fd, MAGIC)
            os.fsync(fd)
            self.size = len(MAGIC)
            return
        if not buf.startswith(MAGIC):
            raise DeepxError(
                f"{self.path} is not a deepx storage file (it does not start with {MAGIC.decode()}); "
                "move it away or point the storage plane at another file"
            )
        records, end, why = read_records(buf)
        for offset, effects in records:
            try:
                for effect in effects:
                    apply_effect(self.data, effect)
            except (TypeError, ValueError, IndexError) as e:
                raise DeepxError(
                    f"{self.path}: the record at byte {offset} does not apply ({e}); the file was written by an "
                    "incompatible version or edited. Move it away to start empty"
                ) from None
        if why:
            log.warning(
                "%s: dropped %d bytes at byte %d (%s, as a crash mid-write leaves); kept %d records",
                self.path,
                len(buf) - end,
                end,
                why,
                len(records),
            )
            os.ftruncate(fd, end)
            os.fsync(fd)
        self.size = end

    # writes, on the event loop

    def check_writable(self) -> None:
        if self.failed:
            raise DeepxError(
                f"the storage file {self.path} cannot be written ({self.failed}); writes are refused until the "
                "daemon is restarted"
            )

    def append(self, effects: list[Effect]) -> None:
        self.check_writable()
        record = frame(effects)
        try:
            _write_all(self.fd, record)
        except OSError as e:
            self.failed = e.strerror or str(e)
            self.check_writable()
        self.size += len(record)
        self.written += 1
        if self._pending is not None:
            self._pending.append(record)
        elif self.size > max(2 * self.compact_size, self.compact_min_bytes) and self._compaction is None:
            self._compaction = asyncio.get_running_loop().create_task(self._compact())

    async def sync(self) -> None:
        """fsync what has been appended, unless another call already did (one fsync serves every waiting write)."""
        if self.synced >= self.written:
            return
        async with self._sync_lock:
            target = self.written
            if self.synced >= target:
                return
            try:
                await asyncio.to_thread(os.fsync, self.fd)
            except OSError as e:
                self.failed = f"fsync: {e.strerror or e}"
                self.check_writable()
            self.synced = max(self.synced, target)

    def start(self) -> None:
        if self.fsync == "everysec":
            self._syncer = asyncio.get_running_loop().create_task(self._sync_every_second())

    async def _sync_every_second(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.sync()
            except DeepxError as e:
                log.error("%s", e)
                return

    async def close(self) -> None:
        if self._compaction is not None:
            await self._compaction
        if self._syncer is not None:
            self._syncer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._syncer
            self._syncer = None
        try:
            if self.fsync != "no" and not self.failed:
                await self.sync()
        except DeepxError as e:
            log.error("%s", e)
        finally:
            async with self._sync_lock:
                os.close(self.fd)
            self.fd = -1

    # compaction while running: the image is taken at once, written and fsynced in a thread, then the records
    # appended meanwhile follow it, and the new file replaces the old with no await between the last check and
    # the rename

    async def _compact(self) -> None:
        try:
            await self._rewrite_running()
        except Exception:
            log.exception("%s: compaction failed", self.path)
        finally:
            self._compaction = None

    async def _rewrite_running(self) -> None:
        image = compact_image(self.data)
        self._pending = []
        tmp = -1
        try:
            tmp = self._create_rewrite()
            size = len(image)
            await asyncio.to_thread(_write_all_and_sync, tmp, image)
            for _ in range(8):
                chunk = b"".join(self._pending)
                self._pending = []
                if not chunk:
                    break
                await asyncio.to_thread(_write_all_and_sync, tmp, chunk)
                size += len(chunk)
            else:
                chunk = b"".join(self._pending)
                _write_all_and_sync(tmp, chunk)
                size += len(chunk)
            old = self._install(tmp, size)
            self.compact_size = len(image)
            self.synced = self.written
        except (OSError, DeepxError) as e:
            log.error("%s: compaction failed, the file is kept as it is: %s", self.path, e)
            self.compact_size = self.size  # the next try waits until the file has doubled
            if tmp >= 0:
                os.close(tmp)
                with contextlib.suppress(OSError):
                    os.unlink(self.path + ".rewrite")
            return
        finally:
            self._pending = None
        log.info("%s: compacted to %d bytes", self.path, size)
        try:
            await asyncio.to_thread(_fsync_dir, os.path.dirname(self.path))
        finally:
            async with self._sync_lock:  # an fsync of the old file may still run in a thread
                os.close(old)

    def _create_rewrite(self) -> int:
        tmp = os.open(self.path + ".rewrite", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            _lock(tmp, self.path + ".rewrite")
        except DeepxError:
            os.close(tmp)
            raise
        return tmp

    def _install(self, tmp: int, size: int) -> int:
        """Rename the rewritten file over the old one; returns the old descriptor for the caller to close."""
        os.replace(self.path + ".rewrite", self.path)
        old, self.fd, self.size = self.fd, tmp, size
        return old


def _parse_url(url: str, fsync: str) -> tuple[str | None, str]:
    parts = urlsplit(url)
    if url != "memory" and parts.scheme != "memory":
        raise DeepxError(f"not an embedded storage URL: {url!r}; use memory or memory:///abs/path/file")
    if parts.netloc:
        raise DeepxError(
            f"storage URL {url!r} names a host ({parts.netloc!r}); a file needs three slashes: memory:///abs/path/file"
        )
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    fsync = options.pop("fsync", fsync)
    if options:
        raise DeepxError(f"storage URL {url!r}: unknown option(s) {', '.join(options)}; only fsync= is known")
    if fsync not in FSYNC_POLICIES:
        raise DeepxError(f"fsync policy {fsync!r} is not one of {', '.join(FSYNC_POLICIES)}")
    path = unquote(parts.path) if url != "memory" else ""
    if not path:
        return None, fsync
    if not path.startswith("/") or path.endswith("/"):
        raise DeepxError(
            f"storage URL {url!r}: the file must be an absolute path to a file, as memory:///abs/path/file"
        )
    return path, fsync


def _lock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DeepxError(
            f"the storage file {path} is in use by another process (or another store in this one); two writers "
            "would corrupt it: use Redis to share a store"
        ) from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_all_and_sync(fd: int, data: bytes) -> None:
    _write_all(fd, data)
    os.fsync(fd)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
