"""The one cache type of the tree: a bounded map that counts its hits, misses and evictions.

Every memo in deepx (the scheduler's plans, rewrites and derived backwards, compiled kernels, the SDK's interning
tables) is a `Cache`, so that each is bounded the same way (the least recently used entry goes first) and
`deepxctl caches` can show its size and hit rate. Two shapes of use:

- a plain map: `get(key)` counts a hit or a miss, `put(key, value)` stores;
- buckets of programs under one probe (`probe(program)` in deepx_core.ir.instr): `bucket(key)` reads a bucket without
  counting, `add(key, item)` appends to it (at most `per_key` items, oldest first out), and the caller, which matches
  the items itself, counts with `hit()` or `miss()`.

`capacity` bounds the number of items (a bucket's items each count). Caches register themselves weakly: `stats()`
lists every live cache of the process.

An interning table on the hot path (the SDK's per-instruction params, the wire's packed instructions) is made with
`counted=False`: its `get` is then the dict's own (a C call, about a fifth of a counted one), and only what was made
(`put`: misses) and evicted is counted.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
F = TypeVar("F", bound=Callable[..., Any])

_LIVE: weakref.WeakSet[Cache[Any, Any]] = weakref.WeakSet()


class Cache(Generic[K, V]):
    """A bounded map, least recently used out first, with counters. Not thread-safe: each owner uses its own from one
    thread at a time (an actor, a session under its lock), as the dicts it replaces were."""

    def __init__(self, name: str, capacity: int, *, per_key: int = 0, owner: str = "", counted: bool = True) -> None:
        if capacity < 1:
            raise ValueError(f"cache {name}: capacity must be at least 1, got {capacity}")
        self.name = name
        self.owner = owner  # who holds it, where a process holds several of one name (two daemons in one process)
        self.capacity = capacity
        self.per_key = per_key  # >0: values are buckets (lists) of at most this many items
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._data: OrderedDict[K, Any] = OrderedDict()
        self._size = 0
        self.counted = counted
        if not counted:  # an instance attribute before the method: dict.get itself, neither counted nor moved
            self.get = self._data.get  # type: ignore[method-assign,assignment]
        _LIVE.add(self)

    # -- a plain map
    def get(self, key: K, default: Any = None) -> Any:
        """The value under `key` (now the most recently used), counted as a hit; else `default`, counted as a miss."""
        try:
            value = self._data[key]
        except KeyError:
            self.misses += 1
            return default
        self._data.move_to_end(key)
        self.hits += 1
        return value

    def peek(self, key: K, default: Any = None) -> Any:
        """The value under `key`, neither counted nor moved."""
        return self._data.get(key, default)

    def put(self, key: K, value: V) -> V:
        """Store `value` under `key` (the least recently used go past capacity); returns `value`."""
        if not self.counted:
            self.misses += 1
        if key in self._data:
            self._size -= self._weight(self._data[key])
            self._data.move_to_end(key)
        self._data[key] = value
        self._size += self._weight(value)
        self._shrink()
        return value

    def pop(self, key: K, default: Any = None) -> Any:
        if key not in self._data:
            return default
        value = self._data.pop(key)
        self._size -= self._weight(value)
        return value

    # -- buckets
    def bucket(self, key: K) -> list[Any]:
        """The items under `key` (an empty list where none, or where the key does not hash), not counted; the caller
        matches them and counts."""
        try:
            found = self._data.get(key)
        except TypeError:
            return []
        return found if found is not None else []

    def add(self, key: K, item: Any) -> None:
        """Append `item` to the bucket under `key` (its oldest item goes past per_key); nothing where the key does not
        hash."""
        try:
            found = self._data.get(key)
        except TypeError:
            return
        if found is None:
            self._data[key] = [item]
        else:
            self._data.move_to_end(key)
            found.append(item)
            if len(found) > self.per_key:
                del found[0]
                self._size -= 1
                self.evictions += 1
        self._size += 1
        self._shrink()

    def discard(self, key: K, item: Any) -> None:
        """Take `item` (by identity) out of the bucket under `key`; the bucket goes when it empties."""
        found = self._data.get(key)
        if found is None:
            return
        for i, x in enumerate(found):
            if x is item:
                del found[i]
                self._size -= 1
                break
        if not found:
            del self._data[key]

    def hit(self, key: Any = None) -> None:
        """Count a hit; `key`: the bucket it was found in, now the most recently used."""
        self.hits += 1
        if key is not None and key in self._data:
            self._data.move_to_end(key)

    def miss(self) -> None:
        self.misses += 1

    # -- both
    def clear(self) -> None:
        self._data.clear()
        self._size = 0

    def __len__(self) -> int:
        """Items held (a bucket's each count)."""
        return self._size

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def values(self) -> Iterator[Any]:
        return iter(self._data.values())

    def newest(self) -> Iterator[Any]:
        """The values, the most recently used first."""
        return reversed(self._data.values())

    def items(self) -> Iterator[tuple[K, Any]]:
        return iter(self._data.items())

    def stats(self) -> dict[str, Any]:
        """size, capacity, hits, misses, hit_rate and evictions; hits and hit_rate are None where not counted."""
        looked = self.hits + self.misses
        hits = self.hits if self.counted else None
        rate = (self.hits / looked if looked else 0.0) if self.counted else None
        return {"cache": self.name, "owner": self.owner, "size": self._size, "capacity": self.capacity,
                "hits": hits, "misses": self.misses, "hit_rate": rate, "evictions": self.evictions}

    def __repr__(self) -> str:
        return f"Cache({self.name!r}, {self._size}/{self.capacity}, hits={self.hits}, misses={self.misses})"

    def _weight(self, value: Any) -> int:
        return len(value) if self.per_key else 1

    def _shrink(self) -> None:
        data = self._data
        while self._size > self.capacity and data:
            _, value = data.popitem(last=False)
            w = self._weight(value)
            self._size -= w
            self.evictions += w


def memoize(name: str, capacity: int) -> Callable[[F], F]:
    """functools.lru_cache's use as a Cache: `fn(*args)` remembered by its (hashable) positional args."""
    def wrap(fn: F) -> F:
        cache: Cache[Any, Any] = Cache(name, capacity)
        missing = object()

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            value = cache.get(args, missing)
            if value is missing:
                value = fn(*args)
                cache.put(args, value)
            return value

        call.cache = cache  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]
    return wrap


def stats() -> list[dict[str, Any]]:
    """Every live cache of this process, by name then owner."""
    return sorted((c.stats() for c in list(_LIVE)), key=lambda s: (s["cache"], s["owner"]))
