"""deepxctl memory: where the bytes are (per node, owner, kind), the largest tensors, why heap tensors are not
freed (their refcounts and holders), and shared-memory segments that dead processes left (`memory clean`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

from deepxctl.context import Ctl
from deepxctl.schema import HeapRef, OrphanSegment, Tensor, Usage, human_bytes
from deepxctl.term import (
    FORMATS,
    display,
    display_data,
    display_note,
    display_source,
    display_table,
    format_option,
    make_table,
    sections,
    select,
    wide_option,
)

LARGEST = 10


def usage(rows: Sequence[Tensor], key: Callable[[Tensor], str]) -> list[Usage]:
    groups: dict[str, Usage] = {}
    for t in rows:
        u = groups.setdefault(key(t) or "?", Usage(key(t) or "?"))
        u.tensors += 1
        u.bytes += t.bytes
    return sorted(groups.values(), key=lambda u: (-u.bytes, u.name))


def orphans(rows: Sequence[Tensor]) -> list[OrphanSegment]:
    """The segments in this machine's /dev/shm whose process is dead and that no heap record in `rows` (every
    tensor the daemon or plane knows) refers to."""
    from deepxd.shm import orphan_segments

    handles = {t.handle for t in rows if t.kind == "heap" and t.handle}
    return [OrphanSegment(o.name, o.pid, o.node, o.held, o.size) for o in orphan_segments(handles)]


def summarize(rows: Sequence[Tensor], heapmem: dict[str, Any] | None, largest: int = LARGEST,
              detail: bool = False, orphaned: Sequence[OrphanSegment] = ()) -> dict[str, Any]:
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
        "orphans": [o.to_dict(detail) for o in orphaned],
    }


@click.group(invoke_without_command=True)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
              help="Output format.")
@click.option("--filter", "filters", multiple=True, metavar="KEY=VALUE",
              help="Count only tensors whose field KEY equals VALUE (a tensors ls field: node, owner, kind, ...).")
@click.option("--limit", type=click.IntRange(min=1), default=LARGEST, show_default=True,
              help="How many of the largest tensors to list.")
@click.option("--detail", is_flag=True, help="Every field of the largest tensors.")
@wide_option
@click.pass_context
def memory(ctx: click.Context, fmt: str, filters: tuple[str, ...], limit: int, detail: bool) -> None:
    """Bytes per node, per owner and per kind; the largest tensors; each heap tensor's refcount and holders (who
    keeps it from being freed); heapmem's segment pool; segments left in /dev/shm by dead processes (orphans,
    removed by `deepxctl memory clean`).

    \b
      deepxctl memory
      deepxctl memory --filter node=gpu-1 --format json
      deepxctl memory clean
    """
    if ctx.invoked_subcommand is not None:
        return
    ctl: Ctl = ctx.obj
    src = ctl.source()
    known = [Tensor.from_raw(r) for r in src.query("tensors")]
    rows = select(known, Tensor, filters, None)
    report = summarize(rows, src.heapmem(), limit, detail, orphans(known))
    display_source()
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
    if report["orphans"]:
        parts.append(make_table([OrphanSegment(**o) for o in report["orphans"]], OrphanSegment, detail=detail,
                                title="orphaned segments: left by dead processes, no tensor refers to them "
                                      "(deepxctl memory clean removes them)"))
    display(sections(parts))


@memory.command()
@format_option
@click.option("--filter", "filters", multiple=True, metavar="KEY=VALUE",
              help="Remove only orphans whose field KEY equals VALUE (name, pid, node, bytes, size); repeatable.")
@click.pass_obj
def clean(ctl: Ctl, fmt: str, filters: tuple[str, ...]) -> None:
    """Remove the orphaned segments from this machine's /dev/shm.

    Orphans are the segments of dead processes that no heap tensor record of the daemon's plane (or --kv's) refers
    to. A segment of a live process, or one a record names (a restarted daemon adopts it), is never removed.
    --filter KEY=VALUE (name, pid, node, bytes, size) narrows them.

    \b
      deepxctl memory clean
      deepxctl memory clean --filter node=gpu-1
      deepxctl --kv memory:///var/lib/deepx/plane.aof memory clean
    """
    from deepxd.shm import pid_alive, unlink_segment

    src = ctl.source()
    found = select(orphans([Tensor.from_raw(r) for r in src.query("tensors")]), OrphanSegment, filters, None)
    removed = [o for o in found if not pid_alive(o.pid) and unlink_segment(o.name)]
    if fmt != "table":
        display_table(removed, OrphanSegment, fmt=fmt, detail=True)
        return
    if not removed:
        display_note("no orphaned segments")
    for o in removed:
        click.echo(f"removed segment {o.name} ({human_bytes(o.bytes)} held) of dead process {o.pid}, node {o.node}")
