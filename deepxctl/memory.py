"""deepxctl memory: where the bytes are (per node, owner, kind), the largest tensors, and why heap tensors are not
freed (their refcounts and holders)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

from deepxctl.context import Ctl
from deepxctl.schema import HeapRef, Tensor, Usage, human_bytes
from deepxctl.term import FORMATS, display, display_data, make_table, sections, select

LARGEST = 10


def usage(rows: Sequence[Tensor], key: Callable[[Tensor], str]) -> list[Usage]:
    groups: dict[str, Usage] = {}
    for t in rows:
        u = groups.setdefault(key(t) or "?", Usage(key(t) or "?"))
        u.tensors += 1
        u.bytes += t.bytes
    return sorted(groups.values(), key=lambda u: (-u.bytes, u.name))


def summarize(rows: Sequence[Tensor], heapmem: dict[str, Any] | None, largest: int = LARGEST,
              detail: bool = False) -> dict[str, Any]:
    """The memory report as plain data: the same fields the tables show."""
    heap = [HeapRef.from_tensor(t) for t in rows if t.kind == "heap"]
    return {
        "total_bytes": sum(t.bytes for t in rows),
        "tensors": len(rows),
        "by_node": [u.to_dict() for u in usage(rows, lambda t: t.node)],
        "by_owner": [u.to_dict() for u in usage(rows, lambda t: t.owner)],
        "by_kind": [u.to_dict() for u in usage(rows, lambda t: t.kind)],
        "largest": [t.to_dict(detail) for t in sorted(rows, key=lambda t: (-t.bytes, t.name))[:largest]],
        "heap": [h.to_dict() for h in sorted(heap, key=lambda h: (-h.refcount, -h.bytes, h.name))],
        "heapmem": heapmem,
    }


@click.command()
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
              help="Output format.")
@click.option("--filter", "filters", multiple=True, metavar="KEY=VALUE",
              help="Count only tensors whose field KEY equals VALUE (a tensors ls field: node, owner, kind, ...).")
@click.option("--limit", type=click.IntRange(min=1), default=LARGEST, show_default=True,
              help="How many of the largest tensors to list.")
@click.option("--detail", is_flag=True, help="Every field of the largest tensors.")
@click.pass_obj
def memory(ctl: Ctl, fmt: str, filters: tuple[str, ...], limit: int, detail: bool) -> None:
    """Bytes per node, per owner and per kind; the largest tensors; each heap tensor's refcount and holders (who
    keeps it from being freed); heapmem's segment pool.

    \b
      deepxctl memory
      deepxctl memory --filter node=gpu-1 --format json
    """
    src = ctl.source()
    rows = select([Tensor.from_raw(r) for r in src.query("tensors")], Tensor, filters, None)
    report = summarize(rows, src.heapmem(), limit, detail)
    if fmt != "table":
        display_data(report, fmt)
        return
    from rich.markup import escape

    parts: list[Any] = [f"[bold]{human_bytes(report['total_bytes'])}[/] in {report['tensors']} tensors"]
    for key in ("node", "owner", "kind"):
        parts.append(make_table([Usage(**u) for u in report[f"by_{key}"]], Usage, title=f"by {key}",
                                first_header=key.upper()))
    parts.append(make_table([Tensor(**t) for t in report["largest"]], Tensor, detail=detail,
                            title=f"largest {min(limit, len(rows))} tensors"))
    parts.append(make_table([HeapRef(**h) for h in report["heap"]], HeapRef,
                            title="heap tensors: references (freed when the refcount reaches 0)"))
    pool = report["heapmem"]
    if pool:
        parts.append(f"[bold]heapmem[/] on {escape(str(pool.get('node', '?')))}: {pool.get('tensors', 0)} tensors in "
                     f"{pool.get('segments', 0)} segments ({human_bytes(pool.get('segment_bytes', 0))} mapped), "
                     f"{pool.get('lost', 0)} lost; pool: {pool.get('pooled_segments', 0)} free segments, "
                     f"{human_bytes(pool.get('pooled_bytes', 0))} of {human_bytes(pool.get('pool_limit', 0))}")
    display(sections(parts))
