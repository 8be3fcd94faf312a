"""The distributed storage plane: Redis 6.2+ or Valkey through redis.asyncio (hiredis parses replies when installed).

One blocking connection pool per store; a command that meets a dropped connection or a timeout is retried on a fresh
connection with exponential backoff (redis-py's Retry), so a Redis restart costs the callers a pause, not an error.
A retried write can be applied twice if the server ran it before the connection dropped (see docs/storage.md).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from redis import exceptions as rx
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff

from deepx_core.errors import DeepxError
from deepxd.kv.base import (
    KV,
    HashValue,
    QueuedBatch,
    as_bytes,
    check_count,
    check_field,
    check_float,
    check_int,
    check_key,
    escape_glob,
    hash_mapping,
    redact,
    url_password,
    wrong_type,
)

BACKOFF_BASE = 0.05  # seconds; the n-th retry waits min(cap, base * 2**n): 0.1, 0.2, 0.4, ... 2.0
BACKOFF_CAP = 2.0
MIN_VERSION = (6, 2)  # LPOP with a count, BLMOVE

# the type each command expects, for the WRONGTYPE message
_EXPECTS = {"get": "string", "rpush": "list", "lpop": "list", "lrange": "list", "llen": "list", "wait_push": "list"}


class RedisKV(KV):
    """The storage plane on a Redis server (see the module docstring)."""

    def __init__(
        self,
        url: str,
        prefix: str = "deepx:",
        connect_timeout: float = 2.0,
        retries: int = 6,
        socket_timeout: float = 10.0,
        max_connections: int = 64,
        password: str | None = None,
    ) -> None:
        check_url(url)
        if password and url_password(url):
            raise DeepxError(f"Redis URL {redact(url)} carries a password and one was given apart from it "
                             "(kv_password, DEEPX_KV_PASSWORD or a password file): give it once")
        self.url = url
        self.password = password or None
        self.prefix = prefix
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.socket_timeout = socket_timeout
        self.max_connections = max_connections
        self._client: Redis | None = None

    async def connect(self) -> None:
        if self._client is not None:
            return
        where = redact(self.url)
        try:
            pool = BlockingConnectionPool.from_url(
                self.url,
                max_connections=self.max_connections,
                timeout=self.socket_timeout,  # how long a command waits for a free connection
                socket_connect_timeout=self.connect_timeout,
                socket_timeout=self.socket_timeout,
                retry=Retry(ExponentialBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE), self.retries),
                retry_on_error=[rx.ConnectionError, rx.TimeoutError],
                decode_responses=False,
                client_name="deepxd",
                **({"password": self.password} if self.password else {}),
            )
        except (ValueError, TypeError) as e:
            raise DeepxError(f"bad Redis URL {where}: {e}") from None
        try:
            await self._probe(pool)
        except BaseException:
            await pool.aclose()
            raise
        self._client = Redis.from_pool(pool)

    async def _probe(self, pool: BlockingConnectionPool) -> None:
        """PING once, without retries, so that an unreachable server is reported within connect_timeout; then
        check the version."""
        where = redact(self.url)
        kwargs = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0), "socket_timeout": self.connect_timeout}
        try:
            conn = pool.connection_class(**kwargs)
        except (TypeError, ValueError) as e:  # a query parameter redis-py passes on but no connection takes
            raise DeepxError(f"bad Redis URL {where}: {e}") from None
        try:
            async with asyncio.timeout(self.connect_timeout + 1.0):
                await conn.connect()
                await conn.send_command("INFO", "server")
                info = await conn.read_response()
        except TimeoutError:
            raise DeepxError(f"cannot reach Redis at {where}: no answer within {self.connect_timeout} s") from None
        except (rx.RedisError, OSError) as e:
            text = str(e)
            if isinstance(e, rx.AuthenticationError) or "NOAUTH" in text or "authenticated" in text:
                raise DeepxError(f"Redis at {where} refused the connection: it needs a password, or not this one "
                                 "(give it with kv_password_file or DEEPX_KV_PASSWORD, docs/storage.md): "
                                 f"{text}") from None
            raise DeepxError(f"cannot reach Redis at {where}: {text}") from None
        except (AttributeError, TypeError, ValueError, KeyError, IndexError) as e:
            # redis-py reads a handshake answer it did not expect this way (redis-py 8's RESP3 HELLO, answered
            # "+OK" by another service, is `'bytes' object has no attribute 'get'`)
            raise DeepxError(f"the server at {where} answered redis-py's handshake not as Redis does: it is not Redis "
                             f"(or Valkey); check the port ({type(e).__name__}: {e})") from None
        finally:
            await conn.disconnect()
        found = re.search(rb"redis_version:(\d+)\.(\d+)", info if isinstance(info, bytes) else b"")
        if not found:  # it answered, but not as Redis does (another service on that port, say)
            raise DeepxError(f"the server at {where} answered INFO without a redis_version: it is not Redis (or "
                             "Valkey); check the port")
        if (int(found[1]), int(found[2])) < MIN_VERSION:
            version = f"{int(found[1])}.{int(found[2])}"
            raise DeepxError(f"Redis at {where} is version {version}; deepx needs Redis 6.2+ or Valkey")

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # strings

    async def get(self, key: str) -> bytes | None:
        value: bytes | None = await self._run("get", key, "GET", self._k(key))
        return value

    async def set(self, key: str, value: bytes) -> None:
        await self._run("set", key, "SET", self._k(key), as_bytes(value, "set"))

    async def set_if_absent(self, key: str, value: bytes) -> bool:
        return bool(await self._run("set_if_absent", key, "SET", self._k(key), as_bytes(value, "set_if_absent"), "NX"))

    async def delete(self, *keys: str) -> int:
        if not keys:
            self._require()
            return 0
        n: int = await self._run("delete", keys[0], "DEL", *(self._k(k) for k in keys))
        return n

    async def exists(self, key: str) -> bool:
        return bool(await self._run("exists", key, "EXISTS", self._k(key)))

    async def missing(self, keys: Sequence[str]) -> list[str]:
        full = [self._k(k) for k in keys]
        client = self._require()
        found: list[Any] = []
        try:
            for at in range(0, len(full), 1000):  # a pipeline of EXISTS, a thousand keys a round trip
                async with client.pipeline(transaction=False) as pipe:
                    for k in full[at:at + 1000]:
                        pipe.exists(k)
                    found += await pipe.execute()
        except rx.RedisError as e:
            raise self._lost("missing", e) from e
        return [k for k, there in zip(keys, found, strict=True) if not there]

    async def keys(self, pattern: str = "*") -> list[str]:
        match, n = escape_glob(self.prefix) + pattern, len(self.prefix)
        found: set[str] = set()
        cursor = 0
        while True:
            cursor, batch = await self._run("keys", pattern, "SCAN", cursor, "MATCH", match, "COUNT", 1000)
            found.update(k.decode("utf-8", "replace")[n:] for k in batch)
            if cursor == 0:
                return sorted(found)

    # hashes

    async def hset(self, key: str, mapping: Mapping[str, HashValue]) -> None:
        fields = hash_mapping(mapping)
        if fields:
            await self._run("hset", key, *_command(("hset", self._k(key), fields)))
        else:
            self._require()

    async def hget(self, key: str, field: str) -> str | None:
        value = await self._run("hget", key, "HGET", self._k(key), check_field(field))
        return None if value is None else value.decode("utf-8")

    async def hgetall(self, key: str) -> dict[str, str]:
        fields = await self._run("hgetall", key, "HGETALL", self._k(key))
        return {f.decode("utf-8"): v.decode("utf-8") for f, v in fields.items()}

    async def hdel(self, key: str, *fields: str) -> int:
        if not fields:
            self._require()
            return 0
        n: int = await self._run("hdel", key, "HDEL", self._k(key), *(check_field(f) for f in fields))
        return n

    async def hincrby(self, key: str, field: str, amount: int = 1) -> int:
        op = ("hincrby", self._k(key), check_field(field), check_int(amount, "hincrby"))
        n: int = await self._run("hincrby", key, *_command(op))
        return n

    async def hincrbyfloat(self, key: str, field: str, amount: float) -> float:
        op = ("hincrbyfloat", self._k(key), check_field(field), check_float(amount, "hincrbyfloat"))
        return float(await self._run("hincrbyfloat", key, *_command(op)))

    # lists

    async def rpush(self, key: str, *values: bytes) -> int:
        items = [as_bytes(v, "rpush") for v in values]
        if not items:
            return await self.llen(key)
        n: int = await self._run("rpush", key, "RPUSH", self._k(key), *items)
        return n

    async def lpop(self, key: str, count: int = 1) -> list[bytes]:
        items = await self._run("lpop", key, "LPOP", self._k(key), check_count(count))
        return items or []

    wakes_on_push = True

    async def wait_push(self, key: str, timeout: float) -> None:
        """Block in the server until list `key` has an item, or `timeout` seconds (at most half the socket timeout):
        BLMOVE from the head to the head of the same list leaves it as it was, so a waiter cancelled at any point
        (its connection is then dropped) takes nothing away."""
        wait = max(0.01, min(float(timeout), self.socket_timeout / 2))
        k = self._k(key)
        await self._run("wait_push", key, "BLMOVE", k, k, "LEFT", "LEFT", wait)

    async def lrange(self, key: str, start: int, stop: int) -> list[bytes]:
        items: list[bytes] = await self._run("lrange", key, "LRANGE", self._k(key), int(start), int(stop))
        return items

    async def llen(self, key: str) -> int:
        n: int = await self._run("llen", key, "LLEN", self._k(key))
        return n

    def batch(self) -> RedisBatch:
        return RedisBatch(self)

    # internals

    def _k(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _prefixed(self, op: tuple[Any, ...]) -> tuple[Any, ...]:
        if op[0] == "delete":
            return ("delete", tuple(self.prefix + k for k in op[1]))
        return (op[0], self.prefix + op[1], *op[2:])

    def _require(self) -> Redis:
        if self._client is None:
            raise DeepxError(f"the storage plane {redact(self.url)} is not connected: call connect() (or `async with`)")
        return self._client

    async def _run(self, op: str, key: str, *command: Any) -> Any:
        client = self._require()
        try:
            return await client.execute_command(*command)
        except rx.ResponseError as e:
            raise self._refused(op, key, e) from None
        except rx.RedisError as e:
            raise self._lost(op, e) from e

    async def _execute(self, ops: list[tuple[Any, ...]]) -> None:
        client = self._require()
        try:
            async with client.pipeline(transaction=True) as pipe:
                for op in ops:
                    pipe.execute_command(*_command(self._prefixed(op)))
                results = await pipe.execute(raise_on_error=False)
        except rx.ResponseError as e:
            raise DeepxError(f"batch of {len(ops)} writes refused by Redis, none applied: {_reason(e)}") from None
        except rx.RedisError as e:
            raise self._lost("batch", e) from e
        for i, (op, result) in enumerate(zip(ops, results)):
            if isinstance(result, Exception):
                key = op[1][0] if op[0] == "delete" else op[1]
                error = self._refused(op[0], key, result)
                raise DeepxError(
                    f"batch: write {i + 1} of {len(ops)} ({op[0]}) failed, the others were applied: {error}"
                )

    def _refused(self, op: str, key: str, error: Exception) -> DeepxError:
        reason = _reason(error)
        if reason.startswith("WRONGTYPE"):
            return wrong_type(op, key, _EXPECTS.get(op, "hash"))
        return DeepxError(f"{op} {key!r}: {reason}")

    def _lost(self, op: str, error: Exception) -> DeepxError:
        return DeepxError(
            f"{op}: lost Redis at {redact(self.url)} ({error}) and {self.retries} reconnects with backoff failed"
        )


class RedisBatch(QueuedBatch):
    def __init__(self, kv: RedisKV) -> None:
        super().__init__()
        self._kv = kv

    async def execute(self) -> None:
        ops, self.ops = self.ops, []
        if ops:
            await self._kv._execute(ops)


def _command(op: tuple[Any, ...]) -> tuple[Any, ...]:
    """The Redis command for an op tuple (as QueuedBatch queues them, with the key already prefixed)."""
    name, key = op[0], op[1]
    if name == "set":
        return ("SET", key, op[2])
    if name == "delete":
        return ("DEL", *key)
    if name == "hset":
        return ("HSET", key, *(x for pair in op[2].items() for x in pair))
    if name == "hdel":
        return ("HDEL", key, *op[2])
    if name == "hincrby":
        return ("HINCRBY", key, op[2], op[3])
    if name == "hincrbyfloat":
        return ("HINCRBYFLOAT", key, op[2], repr(op[3]))
    if name == "rpush":
        return ("RPUSH", key, *op[2])
    raise ValueError(f"unknown write {name!r}")


def _reason(error: Exception) -> str:
    """The server's message, without the command redis-py puts in front of an error inside a pipeline."""
    text = str(error.args[0]) if error.args else str(error)
    text = re.sub(r"^Command # \d+ \(.*?\) of pipeline caused error: ", "", text, flags=re.S)
    return text.strip("(),'\"")


def check_url(url: str) -> None:
    """Refuse what redis-py would quietly misread: it takes `redis://host/1x` as database 0."""
    try:
        parts = urlsplit(url)
    except ValueError as e:  # an unclosed [IPv6 host, say
        raise DeepxError(f"bad Redis URL: {e}") from None
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise DeepxError(f"bad Redis URL {redact(url)}: the port is not a number") from None
    if parts.scheme in ("redis", "rediss") and not re.fullmatch(r"/?([0-9]+)?", parts.path):
        raise DeepxError(f"bad Redis URL {redact(url)}: the path must be a database number, as redis://host:6379/0")
