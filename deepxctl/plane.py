"""Reading the storage plane directly (`deepxctl --kv URL`), for a cluster whose daemons are stopped.

The rows have the shape of the daemon's admin answers (deepxd/actors/registry.py), so the same schemas show them.
The plane holds heap tensors, nodes, op counters and stored programs; stack tensors, actors and heapmem's pool live
only inside a running daemon.

An embedded store's file (`memory:///abs/path`) is read as a snapshot: never locked, repaired, compacted or
created, so looking at it cannot disturb a daemon that starts on it later.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from deepxctl.term import CtlError

PLANE_QUERIES = ("tensors", "ops", "nodes", "graphs")


class Readable(Protocol):
    async def connect(self) -> None: ...
    async def close(self) -> None: ...
    async def keys(self, pattern: str = "*") -> list[str]: ...
    async def hgetall(self, key: str) -> dict[str, str]: ...
    async def get(self, key: str) -> bytes | None: ...


class FileSnapshot:
    """The keys of an embedded store's append-only file as they were when it was read (a torn last record, as a
    crash leaves, is skipped). Read-only: the KV calls deepxctl needs, nothing else."""

    def __init__(self, path: str, prefix: str) -> None:
        self.path = path
        self.prefix = prefix
        self.data: dict[str, Any] = {}

    async def connect(self) -> None:
        from deepxd.kv.memory import MAGIC, apply_effect, read_records

        try:
            buf = Path(self.path).read_bytes()
        except FileNotFoundError:
            raise CtlError(f"no storage file at {self.path}: give the file the daemon was started with "
                           "(--kv memory:///abs/path/file)") from None
        except OSError as e:
            raise CtlError(f"cannot read the storage file {self.path}: {e.strerror or e}") from None
        if not buf.startswith(MAGIC):
            raise CtlError(f"{self.path} is not a deepx storage file (it does not start with {MAGIC.decode()})")
        records, _, _ = read_records(buf)
        try:
            for _, effects in records:
                for effect in effects:
                    apply_effect(self.data, effect)
        except (TypeError, ValueError, IndexError) as e:
            raise CtlError(f"{self.path}: a record does not apply ({e}); was it written by another version?") from None

    async def close(self) -> None:
        self.data = {}

    async def keys(self, pattern: str = "*") -> list[str]:
        from deepxd.kv.base import compile_glob

        match, n = compile_glob(pattern).fullmatch, len(self.prefix)
        return sorted(k[n:] for k in self.data
                      if k.startswith(self.prefix) and match(k[n:].encode("utf-8", "surrogatepass")))

    async def hgetall(self, key: str) -> dict[str, str]:
        v = self.data.get(self.prefix + key)
        return dict(v) if isinstance(v, dict) else {}

    async def get(self, key: str) -> bytes | None:
        v = self.data.get(self.prefix + key)
        return v if isinstance(v, bytes) else None


def open_plane(url: str, prefix: str, password: str | None = None) -> Readable:
    if url == "memory":
        raise CtlError("--kv memory is a store inside one daemon's process; give memory:///abs/path/file or "
                       "redis://host:port/db")
    if url.startswith("memory:"):
        from urllib.parse import unquote, urlsplit

        parts = urlsplit(url)
        path = unquote(parts.path)
        if parts.netloc or not path.startswith("/") or path.endswith("/"):
            raise CtlError(f"storage URL {url!r}: name the file by its absolute path, as memory:///abs/path/file")
        return FileSnapshot(path, prefix)
    from deepxd.kv.base import open_kv

    return open_kv(url, prefix=prefix, password=password)


# -- the rows, in the shape of the registry's answers

async def plane_tensors(kv: Readable) -> list[dict[str, Any]]:
    from deepxd.owners import shown

    rows = []
    for key in await kv.keys("tensor:*"):
        h = await _hash(kv, key)
        if not h:
            continue
        row: dict[str, Any] = {"name": key.split(":", 1)[1], **h}
        if isinstance(row.get("shape"), str):
            try:
                row["shape"] = json.loads(row["shape"])
            except ValueError:
                pass
        rows.append(shown(row))  # the owner as the daemon shows it (deepxd/owners.py)
    return rows


async def plane_ops(kv: Readable) -> list[dict[str, Any]]:
    rows = []
    for key in await kv.keys("ops:*"):
        parts = key.split(":", 2)
        if len(parts) != 3:
            continue
        _, node, worker = parts
        ops: dict[str, dict[str, float]] = {}
        for field, value in (await _hash(kv, key)).items():
            op, _, stat = field.rpartition(".")
            if stat in ("calls", "seconds", "bytes"):
                try:
                    ops.setdefault(op, {})[stat] = float(value)
                except ValueError:
                    continue
        for op, s in ops.items():
            calls = int(s.get("calls", 0))
            secs = s.get("seconds", 0.0)
            rows.append({"node": node, "worker": worker, "op": op, "calls": calls, "total_s": secs,
                         "mean_us": secs / calls * 1e6 if calls else 0.0, "bytes": int(s.get("bytes", 0))})
    return sorted(rows, key=lambda r: -r["total_s"])


async def plane_nodes(kv: Readable) -> list[dict[str, Any]]:
    now = time.time()
    rows = []
    for key in await kv.keys("node:*"):
        h = await _hash(kv, key)
        try:
            hb = float(h.get("heartbeat", 0) or 0)
        except ValueError:
            hb = 0.0
        try:
            addresses = json.loads(h.get("addresses", "{}") or "{}")
        except ValueError:
            addresses = {"?": h.get("addresses", "")}
        rows.append({"node": key.split(":", 1)[1], "roles": h.get("roles", ""), "pid": h.get("pid", ""),
                     "state": h.get("state", ""), "addresses": addresses, "devices": h.get("devices", ""),
                     "heartbeat_age_s": round(now - hb, 3) if hb else None, "started": h.get("started", 0),
                     "blas": h.get("blas", ""), "host": h.get("host", ""), "heartbeat_s": h.get("heartbeat_s"),
                     "peer_timeout_s": h.get("peer_timeout_s")})
    return rows


async def plane_graphs(kv: Readable) -> list[dict[str, Any]]:
    from deepx_core.errors import DeepxError

    rows: list[dict[str, Any]] = []
    for key in await kv.keys("graph:*"):
        try:
            data = await kv.get(key)
        except DeepxError as e:
            rows.append({"name": key.split(":", 1)[1], "data": None, "error": str(e)})
            continue
        if data is not None:
            rows.append({"name": key.split(":", 1)[1], "data": data})
    return rows


async def _hash(kv: Readable, key: str) -> dict[str, str]:
    from deepx_core.errors import DeepxError

    try:
        return await kv.hgetall(key)
    except DeepxError:  # a key of another type under a name deepx uses: not ours to show
        return {}


READERS: dict[str, Callable[[Readable], Awaitable[Any]]] = {
    "tensors": plane_tensors, "ops": plane_ops, "nodes": plane_nodes, "graphs": plane_graphs,
}


class PlaneSource:
    """What the storage plane at `url` says, in the daemon's answer shapes."""

    def __init__(self, url: str, prefix: str, *, password: str | None = None) -> None:
        self.url = url
        self.prefix = prefix
        self.password = password
        from deepxd.kv.base import redact

        self.where = f"the storage plane at {redact(url)}"  # never a password (docs/storage.md)
        self.answered_by = f"{self.where} (--kv: no daemon asked)"

    def query(self, what: str) -> Any:
        reader = READERS.get(what)
        if reader is None:
            raise CtlError(f"{what} need a running deepxd: the storage plane records only "
                           f"{', '.join(PLANE_QUERIES)}; drop --kv and give --address")
        return asyncio.run(self._read(reader))

    async def _read(self, reader: Callable[[Readable], Awaitable[Any]]) -> Any:
        kv = open_plane(self.url, self.prefix, self.password)
        await kv.connect()
        try:
            return await reader(kv)
        finally:
            await kv.close()

    def heapmem(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass
