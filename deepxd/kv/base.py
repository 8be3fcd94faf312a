"""The storage plane's contract: one small async key-value API that the embedded store and Redis both implement.

Keys are given without the plane's prefix (the backend adds it, default `deepx:`). String values and list items are
bytes; hash fields are str and hash values are str (numbers are written with str() and read back as str).
A backend that cannot reach its store raises DeepxError from `connect()`; a command on a key of another type (hset on
a string: Redis's WRONGTYPE) or with a bad argument raises DeepxError; a write with nothing to write (an empty
mapping, no values) does nothing. The checks at the bottom of this file are shared, so both backends accept and
refuse exactly the same things.

Keys used by deepx (design.md section 4):

| key                  | type   | holds                                                                      |
| -------------------- | ------ | -------------------------------------------------------------------------- |
| tensor:<name>        | hash   | dtype, shape, node, device, bytes, kind, owner, state, refcount, handle... |
| node:<id>            | hash   | addresses, roles, pid, devices, started, heartbeat                          |
| ops:<node>:<worker>  | hash   | op name -> calls / total time / bytes (fields `<op>.calls`, ...)            |
| graph:<name>         | string | a stored program (msgpack)                                                 |
| tensor_lifecycle     | list   | create/get/delete commands for heapmem (msgpack maps)                      |
"""

from __future__ import annotations

import abc
import asyncio
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from deepx_core.auth import read_secret_file
from deepx_core.cache import memoize
from deepx_core.errors import DeepxError

HashValue = str | int | float | bytes


class Batch(abc.ABC):
    """Writes collected and sent together at the end of `async with kv.batch() as b:` (one round trip on Redis).
    Nothing is sent if the block raises. Like a Redis MULTI/EXEC, the writes are applied together and every one runs
    even if another fails (a wrong type); execute() then raises DeepxError naming the first that failed."""

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None: ...
    @abc.abstractmethod
    def delete(self, *keys: str) -> None: ...
    @abc.abstractmethod
    def hset(self, key: str, mapping: Mapping[str, HashValue]) -> None: ...
    @abc.abstractmethod
    def hdel(self, key: str, *fields: str) -> None: ...
    @abc.abstractmethod
    def hincrby(self, key: str, field: str, amount: int = 1) -> None: ...
    @abc.abstractmethod
    def hincrbyfloat(self, key: str, field: str, amount: float) -> None: ...
    @abc.abstractmethod
    def rpush(self, key: str, *values: bytes) -> None: ...

    async def __aenter__(self) -> Batch:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            await self.execute()

    @abc.abstractmethod
    async def execute(self) -> None: ...


class QueuedBatch(Batch):
    """A Batch that checks each write when it is called and queues it as a tuple (`op`, key, args...), the same
    tuples a backend's single-write methods build; the backend's execute() sends `self.ops`."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, ...]] = []

    def set(self, key: str, value: bytes) -> None:
        self.ops.append(("set", check_key(key), as_bytes(value, "set")))

    def delete(self, *keys: str) -> None:
        if keys:
            self.ops.append(("delete", tuple(check_key(k) for k in keys)))

    def hset(self, key: str, mapping: Mapping[str, HashValue]) -> None:
        fields = hash_mapping(mapping)
        if fields:
            self.ops.append(("hset", check_key(key), fields))

    def hdel(self, key: str, *fields: str) -> None:
        if fields:
            self.ops.append(("hdel", check_key(key), tuple(check_field(f) for f in fields)))

    def hincrby(self, key: str, field: str, amount: int = 1) -> None:
        self.ops.append(("hincrby", check_key(key), check_field(field), check_int(amount, "hincrby")))

    def hincrbyfloat(self, key: str, field: str, amount: float) -> None:
        self.ops.append(("hincrbyfloat", check_key(key), check_field(field), check_float(amount, "hincrbyfloat")))

    def rpush(self, key: str, *values: bytes) -> None:
        if values:
            self.ops.append(("rpush", check_key(key), tuple(as_bytes(v, "rpush") for v in values)))


class KV(abc.ABC):
    """An async key-value store under a key prefix. Use as `async with backend:` or connect()/close()."""

    url: str
    prefix: str

    @abc.abstractmethod
    async def connect(self) -> None:
        """Open the store; DeepxError with the URL and the reason when it cannot be reached or read."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush and release; idempotent."""

    async def __aenter__(self) -> KV:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # strings
    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None: ...
    @abc.abstractmethod
    async def set(self, key: str, value: bytes) -> None: ...
    @abc.abstractmethod
    async def set_if_absent(self, key: str, value: bytes) -> bool:
        """Set `key` only where no key of that name exists (Redis's SET NX), in one step; whether it was set."""
    @abc.abstractmethod
    async def delete(self, *keys: str) -> int:
        """Delete keys of any type; returns how many existed."""
    @abc.abstractmethod
    async def exists(self, key: str) -> bool: ...
    @abc.abstractmethod
    async def missing(self, keys: Sequence[str]) -> list[str]:
        """Those of `keys` that do not exist, in their order: one round trip for many keys (no scan of the rest)."""
    @abc.abstractmethod
    async def keys(self, pattern: str = "*") -> list[str]:
        """Keys (without the prefix) matching a glob pattern (`*`, `?`, `[abc]`), sorted."""

    # hashes
    @abc.abstractmethod
    async def hset(self, key: str, mapping: Mapping[str, HashValue]) -> None: ...
    @abc.abstractmethod
    async def hget(self, key: str, field: str) -> str | None: ...
    @abc.abstractmethod
    async def hgetall(self, key: str) -> dict[str, str]: ...
    @abc.abstractmethod
    async def hdel(self, key: str, *fields: str) -> int: ...
    @abc.abstractmethod
    async def hincrby(self, key: str, field: str, amount: int = 1) -> int: ...
    @abc.abstractmethod
    async def hincrbyfloat(self, key: str, field: str, amount: float) -> float: ...

    # lists
    @abc.abstractmethod
    async def rpush(self, key: str, *values: bytes) -> int: ...
    @abc.abstractmethod
    async def lpop(self, key: str, count: int = 1) -> list[bytes]:
        """Up to `count` items from the head; [] when the list is empty or missing."""
    @abc.abstractmethod
    async def lrange(self, key: str, start: int, stop: int) -> list[bytes]:
        """Items start..stop inclusive, negative indices from the end (Redis LRANGE)."""
    @abc.abstractmethod
    async def llen(self, key: str) -> int: ...

    async def wait_push(self, key: str, timeout: float) -> None:
        """Return when list `key` may have items to pop: here after `timeout` seconds (a poll). A store that is told
        of every push (`wakes_on_push`) returns as soon as there are items, and sooner than `timeout` only then (the
        embedded store waits without a timeout)."""
        await asyncio.sleep(timeout)

    #: whether wait_push returns when an item comes, so that a waiter may wait long instead of polling
    wakes_on_push = False

    # batches
    @abc.abstractmethod
    def batch(self) -> Batch: ...


# Checks and conversions both backends apply, so that they accept and return exactly the same things.

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_key(key: Any) -> str:
    if not isinstance(key, str):
        raise DeepxError(f"storage keys are str, got {type(key).__name__} {key!r}")
    return key


def check_field(field: Any) -> str:
    if not isinstance(field, str):
        raise DeepxError(f"hash fields are str, got {type(field).__name__} {field!r}")
    return field


def as_bytes(value: Any, op: str) -> bytes:
    """String values and list items are bytes (bytearray and memoryview are copied); anything else is refused."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise DeepxError(f"{op}: values are bytes, got {type(value).__name__}; encode it first (msgpack, .encode())")


def hash_text(field: str, value: Any) -> str:
    """A hash value as the str it is stored and read back as: numbers through str(), bytes as UTF-8."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float | numbers.Real):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise DeepxError(
                f"hash field {field!r}: the value is bytes that are not UTF-8; hash values are text, so store "
                "binary data under a string key with set()"
            ) from None
    raise DeepxError(f"hash field {field!r}: cannot store a {type(value).__name__}; use str, int, float or bytes")


def hash_mapping(mapping: Mapping[str, HashValue]) -> dict[str, str]:
    return {check_field(f): hash_text(f, v) for f, v in mapping.items()}


def check_int(amount: Any, op: str) -> int:
    if not isinstance(amount, int) or not INT64_MIN <= amount <= INT64_MAX:
        raise DeepxError(f"{op}: the amount must be an int within 64 bits, got {amount!r}")
    return int(amount)


def check_float(amount: Any, op: str) -> float:
    if not isinstance(amount, numbers.Real) or not math.isfinite(amount):
        raise DeepxError(f"{op}: the amount must be a finite number, got {amount!r}")
    return float(amount)


def check_count(count: Any) -> int:
    if not isinstance(count, int) or count < 0:
        raise DeepxError(f"lpop: count must be an int >= 0, got {count!r}")
    return count


def wrong_type(op: str, key: str, expected: str, held: str = "another type") -> DeepxError:
    """The error for Redis's WRONGTYPE, worded the same by both backends."""
    return DeepxError(f"{op} {key!r}: the key holds {held}, not a {expected} (WRONGTYPE); delete it or use another key")


def escape_glob(text: str) -> str:
    """`text` as a glob pattern that matches exactly it (for a key prefix inside a Redis MATCH pattern)."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


@memoize("kv.base.compile_glob", 256)
def compile_glob(pattern: str) -> re.Pattern[bytes]:
    """A Redis glob pattern as a regex over a key's UTF-8 bytes, with exactly Redis's rules (util.c stringmatchlen):
    `*`, `?` (one byte), `[abc]`, `[^abc]`, `[a-z]` (ends in either order), `\\x` for a literal x; an unclosed `[`
    runs to the end of the pattern. Use with fullmatch()."""
    p = pattern.encode("utf-8", "surrogatepass")
    n, i = len(p), 0
    out: list[bytes] = []
    while i < n:
        c = p[i]
        if c == 0x2A:  # *
            while i < n and p[i] == 0x2A:
                i += 1
            out.append(b".*")
            continue
        if c == 0x3F:  # ?
            out.append(b".")
        elif c == 0x5B:  # [
            i += 1
            negate = i < n and p[i] == 0x5E
            i += negate
            ranges: list[tuple[int, int]] = []
            while i < n:
                c = p[i]
                if c == 0x5C and n - i >= 2:
                    ranges.append((p[i + 1], p[i + 1]))
                    i += 1
                elif c == 0x5D:
                    break
                elif n - i >= 3 and p[i + 1] == 0x2D:
                    ranges.extend(_signed_range(c, p[i + 2]))
                    i += 2
                else:
                    ranges.append((c, c))
                i += 1
            body = b"".join(b"\\x%02x-\\x%02x" % r for r in ranges)
            out.append((b"[^" + body + b"]" if body else b".") if negate else (b"[" + body + b"]" if body else b"(?!)"))
        elif c == 0x5C and n - i >= 2:
            i += 1
            out.append(re.escape(p[i : i + 1]))
        else:
            out.append(re.escape(p[i : i + 1]))
        i += 1
    return re.compile(b"".join(out), re.DOTALL)


def _signed_range(a: int, b: int) -> list[tuple[int, int]]:
    """Redis compares class ranges as C `char`, signed on the usual platforms: a range over bytes >= 0x80 wraps."""
    lo, hi = sorted((a - 256 if a > 127 else a, b - 256 if b > 127 else b))
    if lo >= 0 or hi < 0:
        return [(lo & 0xFF, hi & 0xFF)]
    return [(0, hi), (lo & 0xFF, 0xFF)]


def open_kv(url: str, prefix: str = "deepx:", *, password: str | None = None, **options: Any) -> KV:
    """The backend for a URL: `memory`, `memory:///path/to/file` (persisted) or `redis://host:port/db`. A Redis
    password comes from `password`, else from `kv_password()` (DEEPX_KV_PASSWORD_FILE, DEEPX_KV_PASSWORD), so that it
    never has to sit in a URL on a command line."""
    if url == "memory" or url.startswith("memory:"):
        from deepxd.kv.memory import MemoryKV

        return MemoryKV(url, prefix=prefix, **options)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from deepxd.kv.redis import RedisKV

        return RedisKV(url, prefix=prefix, password=password if password is not None else kv_password(), **options)
    raise DeepxError(f"unknown storage plane URL {url!r}: use memory, memory:///path/file or redis://host:port/db")


_AUTHORITY = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)(.*)@", re.S)  # greedy: up to the last '@'
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.I)


def redact(url: str) -> str:
    """The URL with any password replaced by ***, for messages and logs: read from the raw text (a password with an
    unencoded '#', '/' or '?' is still found), never by parsing the URL, so it cannot raise."""
    m = None if url.startswith("memory") else _AUTHORITY.match(url)  # a file path may hold ':' and '@'
    if m is not None:
        user, sep, _ = m.group(2).partition(":")
        url = f"{m.group(1)}{user}{':***' if sep else ''}@{url[m.end():]}"
    return _QUERY_PASSWORD.sub(r"\1***", url)


def url_password(url: str) -> str | None:
    """The password a storage URL carries (in its user part, or redis-py's `?password=`), None when it carries none;
    read from the raw text as `redact` reads it."""
    if url.startswith("memory"):
        return None
    m = _AUTHORITY.match(url)
    if m is not None and ":" in m.group(2) and m.group(2).partition(":")[2]:
        return m.group(2).partition(":")[2]
    q = re.search(r"[?&]password=([^&#]*)", url, re.I)
    return q.group(1) if q and q.group(1) else None


def read_password_file(path: str) -> str:
    """A Redis password from a file: its first line, without the line end; a file others can read is refused."""
    return read_secret_file(path, "kv_password_file", "password")


def kv_password(env: Mapping[str, str] | None = None) -> str | None:
    """The Redis password from the environment: the file DEEPX_KV_PASSWORD_FILE names, else DEEPX_KV_PASSWORD;
    None when neither is set."""
    environ = os.environ if env is None else env
    path = environ.get("DEEPX_KV_PASSWORD_FILE")
    if path:
        return read_password_file(path)
    return environ.get("DEEPX_KV_PASSWORD") or None
