"""One schema per object that deepxctl shows. A table's columns and the JSON/YAML keys are the same dataclass fields,
so they never drift apart; a field's metadata gives its column header, whether it shows only with --detail, and how
a table cell renders it (JSON and YAML keep the raw value).

Each schema's `from_raw` reads the rows the daemon's admin queries (deepxd/actors/registry.py) answer, or that
deepxctl reads from the storage plane in the same shape (deepxctl/plane.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any, ClassVar, TypeVar

S = TypeVar("S", bound="Schema")


def human_bytes(n: Any) -> str:
    if n is None or n == "":
        return ""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # unreachable


def human_rate(n: Any) -> str:
    return f"{human_bytes(n)}/s" if n else ""


def seconds(v: Any) -> str:
    if v is None:
        return ""
    v = float(v)
    if v < 1e-3:
        return f"{v * 1e6:.0f} us"
    if v < 1:
        return f"{v * 1e3:.1f} ms"
    return f"{v:.2f} s"


def micros(v: Any) -> str:
    return "" if v is None else f"{float(v):.1f}"


def shape(v: Any) -> str:
    return "[" + ", ".join(map(str, v)) + "]" if isinstance(v, list | tuple) else str(v)


def words(v: Any) -> str:
    return ", ".join(map(str, v)) if isinstance(v, list | tuple) else str(v)


def urls(v: Any) -> str:
    """Addresses as URLs: {"unix": "unix:///p", "udp": "h:9090"} -> `unix:///p udp://h:9090`."""
    if not isinstance(v, Mapping):
        return str(v)
    return " ".join(str(x) if "://" in str(x) else f"{k}://{x}" for k, x in v.items())


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort key that orders the numbers inside names by value: t2 before t10 (text order put t10 first)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in _DIGITS.split(text) if part)


_DIGITS = re.compile(r"(\d+)")


def timestamp(v: Any) -> str:
    if not v:
        return ""
    return datetime.datetime.fromtimestamp(float(v)).strftime("%Y-%m-%d %H:%M:%S")


def plain(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def col(header: str = "", *, detail: bool = False, render: Callable[[Any], str] = plain,
        right: bool = False, whole: bool = False, tail: bool = False, spare: bool = False) -> dict[str, Any]:
    """A schema field's metadata: `header` (the upper-cased name by default), `detail` (shown only with --detail),
    `render` (its table cell), `right` (right-aligned, for numbers), `whole` (a narrow table wraps the cell but never
    cuts it short: for values deepx bounds, such as a node's roles and addresses, unlike names clients choose),
    `tail` (a narrow table that cuts the cell short keeps its end: a call site's file and line), `spare` (a table
    too narrow for every column's words leaves it out, with a note, the rightmost such column first)."""
    return {"header": header, "detail": detail, "render": render, "right": right, "whole": whole, "tail": tail,
            "spare": spare}


@dataclasses.dataclass
class Schema:
    """Base of every schema: columns, cells, dicts and a tolerant constructor from a raw row."""

    object_name: ClassVar[str] = "rows"

    @classmethod
    def columns(cls, detail: bool = False) -> list[dataclasses.Field[Any]]:
        return [f for f in dataclasses.fields(cls) if detail or not f.metadata.get("detail")]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def header(cls, f: dataclasses.Field[Any]) -> str:
        return f.metadata.get("header") or f.name.upper()

    def cell(self, f: dataclasses.Field[Any]) -> str:
        return f.metadata.get("render", plain)(getattr(self, f.name))

    def to_dict(self, detail: bool = False) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in self.columns(detail)}

    @classmethod
    def from_raw(cls: type[S], raw: Mapping[str, Any]) -> S:
        names = set(cls.field_names())
        return cls(**{k: v for k, v in raw.items() if k in names})


def _int(v: Any) -> int:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return 0


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def _names(v: Any) -> list[str]:
    """A comma list as the plane stores it ("a,b"), or a list, as a list."""
    if isinstance(v, list | tuple):
        return [str(x) for x in v]
    return [x for x in str(v or "").split(",") if x]


@dataclasses.dataclass
class Tensor(Schema):
    object_name: ClassVar[str] = "tensors"

    name: str = field(metadata=col())
    kind: str = field(default="", metadata=col())
    dtype: str = field(default="", metadata=col())
    shape: list[int] = field(default_factory=list, metadata=col(render=shape))
    bytes: int = field(default=0, metadata=col(render=human_bytes, right=True))
    # the session that made it (`train.py[4242]@gpu-1`), else a name a client gave, else the worker holding it
    owner: str = field(default="", metadata=col())
    parameter: str = field(default="", metadata=col(spare=True))  # a model parameter's module path (`0.weight`)
    # the line of the user's code that made it
    call_site: str = field(default="", metadata=col("CALL SITE", tail=True, spare=True))
    node: str = field(default="", metadata=col())
    state: str = field(default="", metadata=col(detail=True))
    device: str = field(default="", metadata=col(detail=True))
    refcount: int | None = field(default=None, metadata=col(detail=True, right=True))
    holders: list[str] = field(default_factory=list, metadata=col(detail=True, render=words))
    handle: str = field(default="", metadata=col(detail=True))
    client: str = field(default="", metadata=col(detail=True))  # the owning session: its program's name,
    pid: int | None = field(default=None, metadata=col(detail=True, right=True))  # process id
    host: str = field(default="", metadata=col(detail=True))  # and host

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> Tensor:
        t = super().from_raw(raw)
        t.bytes = _int(t.bytes)
        t.shape = list(t.shape) if isinstance(t.shape, list | tuple) else t.shape
        t.holders = _names(raw.get("holders"))
        t.refcount = _int(raw["refcount"]) if raw.get("refcount") not in (None, "") else None
        t.pid = _int(raw["pid"]) if raw.get("pid") not in (None, "") else None
        return t


@dataclasses.dataclass
class Op(Schema):
    object_name: ClassVar[str] = "ops"

    node: str = field(metadata=col())
    worker: str = field(metadata=col())
    op: str = field(metadata=col())
    calls: int = field(default=0, metadata=col(right=True))
    mean_us: float = field(default=0.0, metadata=col("MEAN (us)", render=micros, right=True))
    total_s: float = field(default=0.0, metadata=col("TOTAL", render=seconds, right=True))
    bytes_per_s: float = field(default=0.0, metadata=col("THROUGHPUT", render=human_rate, right=True))
    bytes: int = field(default=0, metadata=col("BYTES WRITTEN", detail=True, render=human_bytes, right=True))

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> Op:
        o = super().from_raw(raw)
        o.calls, o.bytes = _int(o.calls), _int(o.bytes)
        o.total_s, o.mean_us = _float(o.total_s), _float(o.mean_us)
        o.bytes_per_s = round(o.bytes / o.total_s, 3) if o.total_s > 0 else 0.0
        return o


def percent(v: Any) -> str:
    return "" if v is None or v == "" else f"{float(v) * 100:.1f}%"


@dataclasses.dataclass
class CacheRow(Schema):
    """One cache of a daemon's process (deepx_core.cache.Cache): how full, how often it found what was asked. HITS
    and HIT RATE are empty for interning tables, whose lookups are not counted (MISSES then counts what they made)."""

    object_name: ClassVar[str] = "caches"

    node: str = field(metadata=col())
    cache: str = field(metadata=col())
    owner: str = field(default="", metadata=col())
    size: int = field(default=0, metadata=col(right=True))
    capacity: int = field(default=0, metadata=col(right=True))
    hits: int | None = field(default=None, metadata=col(right=True))
    misses: int = field(default=0, metadata=col(right=True))
    hit_rate: float | None = field(default=None, metadata=col("HIT RATE", render=percent, right=True))
    evictions: int = field(default=0, metadata=col(right=True))

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> CacheRow:
        c = super().from_raw(raw)
        c.size, c.capacity, c.misses, c.evictions = _int(c.size), _int(c.capacity), _int(c.misses), _int(c.evictions)
        c.hits = None if raw.get("hits") is None else _int(raw["hits"])
        c.hit_rate = None if raw.get("hit_rate") is None else _float(raw["hit_rate"])
        return c


#: a running node whose heartbeat is older than its peer_timeout_s (its record's), or where the record has none this
#: many of its heartbeats (heartbeat_s, 2 s by default), is shown as dead (deepxd/peers.py: the daemons' own rule)
STALE_BEATS = 5
DEFAULT_HEARTBEAT_S = 2.0


@dataclasses.dataclass
class Node(Schema):
    object_name: ClassVar[str] = "nodes"

    node: str = field(metadata=col())
    state: str = field(default="", metadata=col())
    roles: list[str] = field(default_factory=list, metadata=col(render=words, whole=True))
    addresses: dict[str, str] = field(default_factory=dict, metadata=col(render=urls, whole=True))
    heartbeat_age_s: float | None = field(default=None, metadata=col("HEARTBEAT AGE", render=seconds, right=True))
    devices: list[str] = field(default_factory=list, metadata=col(render=words, whole=True))
    # the peer link of the daemon asked to it: unix, tcp, tls, down (link_error says why), self, none (a running peer
    # with no link open: one opens when something needs it); "" read from the plane
    link: str = field(default="", metadata=col(detail=True))
    host: str = field(default="", metadata=col(detail=True))
    link_age_s: float | None = field(default=None, metadata=col("LINK AGE", detail=True, render=seconds, right=True))
    link_error: str = field(default="", metadata=col("LINK ERROR", detail=True))
    pid: int | None = field(default=None, metadata=col(detail=True, right=True))
    started: float = field(default=0.0, metadata=col(detail=True, render=timestamp))
    blas: str = field(default="", metadata=col("BLAS", detail=True))  # op-cpu's matmul: "mkl 2026.2" or "numpy"

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> Node:
        n = super().from_raw(raw)
        n.roles, n.devices = _names(n.roles), _names(n.devices)
        n.pid = _int(raw["pid"]) if raw.get("pid") not in (None, "") else None
        n.started = _float(n.started)
        beat = _float(raw.get("heartbeat_s") or DEFAULT_HEARTBEAT_S)
        timeout = _float(raw.get("peer_timeout_s") or STALE_BEATS * beat)
        if n.state == "running" and n.heartbeat_age_s is not None and n.heartbeat_age_s > timeout:
            n.state = "dead"  # it stopped without saying so (killed, or its host gone): its records are left over
        return n


@dataclasses.dataclass
class OpEntry(Schema):
    """An op of the catalogue (deepx_core/ir/ops.py), as `ops catalogue` lists it."""

    object_name: ClassVar[str] = "ops"

    name: str = field(metadata=col("OP"))
    signature: str = field(default="", metadata=col())
    dtypes: list[str] = field(default_factory=list, metadata=col(render=words))
    grad: bool = field(default=False, metadata=col())  # differentiable: autograd has a rule for it
    doc: str = field(default="", metadata=col())
    family: str = field(default="", metadata=col(detail=True))
    deepxir: bool = field(default=False, metadata=col("DEEPXIR", detail=True))  # one of the existing 60
    expr: str = field(default="", metadata=col(detail=True))


@dataclasses.dataclass
class Actor(Schema):
    object_name: ClassVar[str] = "actors"

    name: str = field(metadata=col())
    role: str = field(default="", metadata=col())
    # an op worker's: cpu, or its GPU (one op-cuda worker per GPU); --detail only, so that the default listing of a
    # daemon on one GPU or none is the one it always was (the names op-cuda:<ordinal> tell the GPUs apart)
    device: str = field(default="", metadata=col(detail=True))
    state: str = field(default="", metadata=col())
    doing: str = field(default="", metadata=col())  # the message being handled now
    doing_s: float | None = field(default=None, metadata=col("FOR", render=seconds, right=True))  # since when
    mailbox: int = field(default=0, metadata=col(right=True))
    handled: int = field(default=0, metadata=col(right=True))
    errors: int = field(default=0, metadata=col(right=True))
    restarts: int = field(default=0, metadata=col(right=True))
    busy_s: float = field(default=0.0, metadata=col("BUSY", detail=True, render=seconds, right=True))
    last_error: str = field(default="", metadata=col(detail=True))


def offered(v: Any) -> str:
    """An executor's ops, each with its cost: `cumprod 40us, mul` (no cost given: placed there only when named)."""
    if not isinstance(v, list | tuple):
        return str(v)
    return ", ".join(f"{o.get('op')} {o['cost_us']:g}us" if isinstance(o, Mapping) and o.get("cost_us") is not None
                     else str(o.get("op") if isinstance(o, Mapping) else o) for o in v)


@dataclasses.dataclass
class ExecutorRow(Schema):
    """An executor of another process registered with the daemon (docs/executor.md)."""

    object_name: ClassVar[str] = "executors"

    name: str = field(metadata=col())
    node: str = field(default="", metadata=col())
    pid: int | None = field(default=None, metadata=col(right=True))
    # the ops it serves: each {op, signature, declared (a new op), cost_us, calls, mean_us}
    ops: list[dict[str, Any]] = field(default_factory=list, metadata=col(render=offered))
    calls: int = field(default=0, metadata=col(right=True))
    errors: int = field(default=0, metadata=col(right=True))
    peer: str = field(default="", metadata=col("CONNECTED", detail=True))  # the listener, and where from
    host: str = field(default="", metadata=col(detail=True))
    attach: bool = field(default=False, metadata=col(detail=True))  # it maps this host's shared memory
    since: float = field(default=0.0, metadata=col(detail=True, render=timestamp))


@dataclasses.dataclass
class Graph(Schema):
    object_name: ClassVar[str] = "graphs"

    name: str = field(metadata=col())
    instructions: int = field(default=0, metadata=col(right=True))
    bytes: int = field(default=0, metadata=col(render=human_bytes, right=True))
    ops: list[str] = field(default_factory=list, metadata=col(render=words))
    error: str = field(default="", metadata=col(detail=True))


@dataclasses.dataclass
class Usage(Schema):
    """Bytes held by one node, owner or kind (the rows of `deepxctl memory`)."""

    object_name: ClassVar[str] = "groups"

    name: str = field(metadata=col())
    tensors: int = field(default=0, metadata=col(right=True))
    bytes: int = field(default=0, metadata=col(render=human_bytes, right=True))


@dataclasses.dataclass
class OrphanSegment(Schema):
    """A shared-memory segment whose process died and that no heap tensor record refers to (`deepxctl memory`)."""

    object_name: ClassVar[str] = "orphaned segments"

    name: str = field(metadata=col())
    pid: int = field(default=0, metadata=col(right=True))
    node: str = field(default="", metadata=col())
    bytes: int = field(default=0, metadata=col(render=human_bytes, right=True))  # memory it holds
    size: int = field(default=0, metadata=col(render=human_bytes, right=True, detail=True))  # its length


@dataclasses.dataclass
class HeapRef(Schema):
    """A heap tensor's references: who holds it, and so why it is not freed."""

    object_name: ClassVar[str] = "heap tensors"

    name: str = field(metadata=col())
    refcount: int = field(default=0, metadata=col(right=True))
    holders: list[str] = field(default_factory=list, metadata=col(render=words))
    bytes: int = field(default=0, metadata=col(render=human_bytes, right=True))
    state: str = field(default="", metadata=col())
    node: str = field(default="", metadata=col())

    @classmethod
    def from_tensor(cls, t: Tensor) -> HeapRef:
        return cls(t.name, t.refcount or 0, list(t.holders), t.bytes, t.state, t.node)
