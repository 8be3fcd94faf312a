"""The Redis backend against real redis-servers: unreachable servers, a restart under a connected client, one round
trip per batch, hiredis, and key globbing that matches Redis's own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import AbstractConnection

from deepx_core.errors import DeepxError
from deepxd.kv.base import compile_glob, escape_glob
from deepxd.kv.redis import RedisKV, redact

NewServer = Callable[[], Any]  # the new_redis_server fixture: starts a redis-server of the test's own


async def test_an_unreachable_server_is_one_line_naming_it(unused_port: int) -> None:
    port = unused_port
    with pytest.raises(DeepxError, match=rf"cannot reach Redis at redis://127.0.0.1:{port}/0: .*(refused|onnect)"):
        await RedisKV(f"redis://127.0.0.1:{port}/0").connect()


@pytest.mark.timeout(30)  # a hang guard: a connect that ignored connect_timeout would wait for the kernel's
async def test_a_silent_address_fails_within_the_connect_timeout() -> None:
    # a non-routable address: no answer (or no route) at all
    with pytest.raises(DeepxError, match=r"cannot reach Redis at redis://10\.255\.255\.1:6379/0"):
        await RedisKV("redis://10.255.255.1:6379/0", connect_timeout=0.5).connect()


async def _counting_server(answer: bool) -> tuple[asyncio.Server, list[int]]:
    """A TCP server on a free port that counts connections and closes each at once (answer) or never answers."""
    accepted: list[int] = []
    held: list[asyncio.StreamWriter] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        if answer:
            writer.close()
        else:
            held.append(writer)  # connected, silent

    return await asyncio.start_server(on_connect, "127.0.0.1", 0), accepted


@pytest.mark.parametrize("answer", [True, False], ids=["closes", "silent"])
@pytest.mark.timeout(30)  # a hang guard: a probe that ignored connect_timeout would wait for ever
async def test_connect_probes_once_without_retries(answer: bool) -> None:
    """connect() tries the server once, with no retry loop and no wait beyond connect_timeout: a server that drops
    the connection, or one that never answers, is reported after exactly one connection."""
    server, accepted = await _counting_server(answer)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(DeepxError, match=rf"(cannot reach|not as Redis does).* redis://127.0.0.1:{port}/0"
                           if answer else rf"cannot reach Redis at redis://127.0.0.1:{port}/0: (no answer|Timeout)"):
            await RedisKV(f"redis://127.0.0.1:{port}/0", connect_timeout=0.5, retries=5).connect()
        assert accepted == [1]
    finally:
        server.close()


async def test_a_password_never_shows_in_errors(unused_port: int) -> None:
    port = unused_port
    with pytest.raises(DeepxError) as caught:
        await RedisKV(f"redis://user:s3cret@127.0.0.1:{port}/0").connect()
    assert "s3cret" not in str(caught.value)
    assert f"redis://user:***@127.0.0.1:{port}/0" in str(caught.value)
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_a_bad_url_is_a_deepx_error() -> None:
    with pytest.raises(DeepxError, match="database number"):
        RedisKV("redis://127.0.0.1:6379/notadb")  # redis-py would quietly use database 0
    with pytest.raises(DeepxError, match="port is not a number"):
        RedisKV("redis://127.0.0.1:port/0")
    RedisKV("redis://127.0.0.1:6379")
    RedisKV("redis://127.0.0.1/15")
    RedisKV("unix:///run/redis.sock?db=1")
    with pytest.raises(DeepxError, match="bad Redis URL: Invalid IPv6 URL"):
        RedisKV("redis://[::1")
    assert redact("redis://[::1") == "redis://[::1"  # no password to hide


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pa#ss@127.0.0.1:6390/0", "redis://:***@127.0.0.1:6390/0"),  # '#', '/', '?' unencoded: urlsplit errs
    ("redis://u:p/w?x@h:1/0", "redis://u:***@h:1/0"),
    ("redis://:pass@h:notaport/0", "redis://:***@h:notaport/0"),  # .port would raise
    ("redis://h:6379/0?password=zz&db=1", "redis://h:6379/0?password=***&db=1"),  # redis-py's query form
    ("unix:///tmp/r.sock?db=0&password=s", "unix:///tmp/r.sock?db=0&password=***"),
    ("rediss://a:b@[::1]:6379/0", "rediss://a:***@[::1]:6379/0"),
    ("redis://user@h/0", "redis://user@h/0"),
    ("memory:///srv/a:b@c.aof", "memory:///srv/a:b@c.aof"),
])
def test_redact_finds_every_password_form(url: str, shown: str) -> None:
    from deepxd.kv.base import url_password

    assert redact(url) == shown
    assert (url_password(url) is None) == (shown == url)


async def test_a_query_parameter_no_connection_takes_is_a_deepx_error(unused_port: int) -> None:
    with pytest.raises(DeepxError, match=r"bad Redis URL .*bogus"):
        await RedisKV(f"redis://127.0.0.1:{unused_port}/0?bogus=1").connect()


async def test_a_server_that_is_not_redis_is_refused_at_connect(unused_port: int) -> None:
    """Another service on the port that answers every line with +OK (so PING and INFO 'work'): refused at once, not
    taken for a Redis whose commands then fail one by one."""
    import asyncio

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readline():
            writer.write(b"+OK\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", unused_port)
    try:
        with pytest.raises(DeepxError, match="not Redis"):
            await RedisKV(f"redis://127.0.0.1:{unused_port}/0").connect()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_restart_under_a_connected_client_is_ridden_out(new_redis_server: NewServer) -> None:
    server = new_redis_server()
    async with RedisKV(server.url, prefix="restart:") as kv:
        await kv.set("a", b"1")
        assert await kv.get("a") == b"1"
        server.stop()  # every pooled connection is now dead
        started = time.monotonic()
        restart = asyncio.create_task(asyncio.to_thread(lambda: (time.sleep(0.3), server.start())))
        await kv.set("b", b"2")  # retried with backoff until the server is back
        assert time.monotonic() - started >= 0.3
        await restart
        assert await kv.get("b") == b"2"
        assert await kv.get("a") is None  # the server kept nothing (--save "")
        server.stop()
        server.start()
        assert await kv.hincrby("h", "n", 3) == 3  # a stale connection is replaced at once


async def test_a_server_that_stays_down_is_a_deepx_error(new_redis_server: NewServer) -> None:
    server = new_redis_server()
    async with RedisKV(server.url, retries=2) as kv:
        await kv.set("a", b"1")
        server.stop()
        with pytest.raises(DeepxError, match=r"lost Redis at .* 2 reconnects"):
            await kv.get("a")
        with pytest.raises(DeepxError, match="lost Redis"):
            async with kv.batch() as b:
                b.set("a", b"2")


async def test_a_batch_is_one_round_trip(redis_server: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sends: list[int] = []
    real = AbstractConnection.send_packed_command

    async def counting(self: AbstractConnection, command: object, check_health: bool = True) -> None:
        sends.append(1)
        await real(self, command, check_health)  # type: ignore[arg-type]

    async with RedisKV(redis_server.url, prefix=prefix) as kv:
        await kv.set("warm", b"")  # the pool's connection exists
        monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
        async with kv.batch() as b:
            for i in range(100):
                b.hset(f"tensor:{i}", {"refcount": 1, "dtype": "float32"})
                b.hincrby("ops:n:cpu", "add.calls", 1)
                b.rpush("tensor_lifecycle", b"create %d" % i)
        assert len(sends) == 1
        monkeypatch.undo()
        assert await kv.hget("ops:n:cpu", "add.calls") == "100"
        assert await kv.llen("tensor_lifecycle") == 100


async def test_replies_are_parsed_by_hiredis(redis_server: Any, prefix: str) -> None:
    async with RedisKV(redis_server.url, prefix=prefix) as kv:
        client = kv._require()
        connection = await client.connection_pool.get_connection()
        try:
            assert type(connection._parser).__name__ == "_AsyncHiredisParser"
        finally:
            await client.connection_pool.release(connection)
        assert await client.execute_command("CLIENT", "GETNAME") == b"deepxd"  # named in CLIENT LIST


async def test_keys_escapes_a_prefix_with_glob_characters(redis_server: Any) -> None:
    async with (
        RedisKV(redis_server.url, prefix="we[i]rd*?\\:") as kv,
        RedisKV(redis_server.url, prefix="wex:") as other,
    ):
        await kv.set("a", b"1")
        await other.set("b", b"2")
        assert await kv.keys() == ["a"]
        assert await kv.keys("?") == ["a"]
        await kv.delete("a")
        await other.delete("b")


# the embedded store matches keys with compile_glob; Redis with its own matcher: they must agree, byte for byte

KEYS = ["", "a", "b", "ab", "ba", "abc", "a-b", "a^", "[a]", "a*b", "a?b", "a\\b", "é", "aé", "-", "]", "^", "\\"]


@pytest.fixture(scope="module")
def glob_keys(redis_server: Any) -> tuple[redis.Redis, str]:
    client = redis.Redis.from_url(redis_server.url)
    prefix = "glob[*]:"
    client.mset({prefix + k: b"" for k in KEYS})
    return client, prefix


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet="ab*?[]^-\\é", max_size=7))
def test_glob_matches_redis(glob_keys: tuple[redis.Redis, str], pattern: str) -> None:
    client, prefix = glob_keys
    found = {k.decode()[len(prefix) :] for k in client.scan_iter(match=escape_glob(prefix) + pattern, count=1000)}
    mine = {k for k in KEYS if compile_glob(pattern).fullmatch(k.encode())}
    assert mine == found, pattern


async def test_a_missing_or_wrong_password_says_so(new_redis_server: NewServer) -> None:
    server = new_redis_server()
    redis.Redis(port=server.port).config_set("requirepass", "s3cret")
    for url in (f"redis://127.0.0.1:{server.port}/0", f"redis://:wrong@127.0.0.1:{server.port}/0"):
        with pytest.raises(DeepxError, match="needs a password, or not this one") as caught:
            await RedisKV(url).connect()
        assert "wrong" not in str(caught.value)
    kv = RedisKV(f"redis://:s3cret@127.0.0.1:{server.port}/0")
    await kv.connect()
    await kv.close()
