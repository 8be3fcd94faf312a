"""deepx_core.cache.Cache: the one cache type (bounded, least recently used out first, counted)."""

from __future__ import annotations

import gc

import pytest

from deepx_core import cache as cache_mod
from deepx_core.cache import Cache, memoize, stats
from deepx_core.ir.instr import Instr, Param, probe
from deepx_core.ir.text import parse_text


def test_a_map_keeps_the_most_recently_used_and_counts() -> None:
    c: Cache[str, int] = Cache("t.map", 2, owner="me")
    assert c.put("a", 1) == 1
    c.put("b", 2)
    assert c.get("a") == 1  # a is now the most recent: b goes first
    c.put("c", 3)
    assert list(c) == ["a", "c"] and "b" not in c and len(c) == 2
    assert c.get("b") is None and c.get("b", -1) == -1
    assert c.peek("a") == 1 and c.hits == 1  # peek neither counts nor moves
    assert c.stats() == {"cache": "t.map", "owner": "me", "size": 2, "capacity": 2, "hits": 1, "misses": 2,
                         "hit_rate": 1 / 3, "evictions": 1}
    c.put("a", 10)  # a replacement is no eviction
    assert c.get("a") == 10 and len(c) == 2 and c.evictions == 1
    assert c.pop("a") == 10 and c.pop("a", "gone") == "gone" and len(c) == 1
    c.clear()
    assert len(c) == 0 and list(c) == []


def test_buckets_count_items_and_drop_the_oldest() -> None:
    c: Cache[str, list[int]] = Cache("t.buckets", 5, per_key=2)
    for i in range(3):
        c.add("k", i)
    assert c.bucket("k") == [1, 2] and len(c) == 2 and c.evictions == 1  # per_key: the oldest went
    c.add("j", 7)
    c.add("j", 8)
    c.add("m", 9)
    assert len(c) == 5
    c.add("n", 10)  # past capacity: the least recently used key goes whole (k, 2 items)
    assert "k" not in c and len(c) == 4 and c.evictions == 3
    assert c.bucket("absent") == [] and "absent" not in c  # reading makes nothing
    item = c.bucket("j")[0]
    c.discard("j", item)
    assert c.bucket("j") == [8] and len(c) == 3
    c.discard("j", 8)  # an equal int is the same object here; the bucket goes when empty
    assert "j" not in c and len(c) == 2
    c.hit()
    c.miss()
    assert (c.hits, c.misses) == (1, 1)
    c.add("p", 11)
    c.hit("m")  # a hit in m's bucket: m is now the most recently used, n the least
    assert list(c) == ["n", "p", "m"] and c.hits == 2


def test_a_key_that_does_not_hash_finds_and_keeps_nothing() -> None:
    c: Cache[object, list[int]] = Cache("t.unhashable", 4, per_key=2)
    instr = Instr("vecset", (Param("vector", (), [1, 2]),), (Param("var", (), "v"),))  # a list inside a param
    key = probe([instr, instr])
    c.add(key, 1)
    assert c.bucket(key) == [] and len(c) == 0
    hashable = parse_text("vecset ([1 2]) -> (v)")  # as parsed: a tuple
    c.add(probe(hashable), 1)
    assert c.bucket(probe(hashable)) == [1]
    with pytest.raises(TypeError):  # a plain get raises as a dict does: the caller knows its keys
        c.get([1])


def test_an_interning_table_counts_what_it_made_only() -> None:
    c: Cache[str, int] = Cache("t.intern", 2, counted=False)
    assert c.get("a") is None and c.misses == 0
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1 and c.hits == 0  # dict.get itself: neither counted nor moved
    c.put("c", 3)
    assert list(c) == ["b", "c"]  # so the first made goes first
    assert c.stats()["hits"] is None and c.stats()["hit_rate"] is None and c.stats()["misses"] == 3


def test_memoize_is_a_cache() -> None:
    calls = []

    @memoize("t.memo", 2)
    def square(x: int) -> int:
        calls.append(x)
        return x * x

    assert [square(2), square(2), square(3), square(4), square(2)] == [4, 4, 9, 16, 4]
    assert calls == [2, 3, 4, 2]  # 2 was the least recently used when 4 came
    c = square.cache  # type: ignore[attr-defined]
    assert (c.hits, c.misses, c.evictions) == (1, 4, 2)


def test_stats_lists_live_caches_only() -> None:
    c: Cache[str, int] = Cache("t.live", 1, owner="zz")
    assert any(s["cache"] == "t.live" and s["owner"] == "zz" for s in stats())
    del c
    gc.collect()
    assert not any(s["cache"] == "t.live" for s in stats())
    names = [s["cache"] for s in stats()]
    assert names == sorted(names)
    assert len(cache_mod._LIVE) >= 1  # the process's own (the wire's tables, at least)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        Cache("t.bad", 0)
