"""deepxctl tensors: ls, show, rm, share."""

from __future__ import annotations

from typing import Any

import click

from deepxctl.context import Ctl
from deepxctl.schema import Tensor, human_bytes, natural_key
from deepxctl.term import (
    Cell,
    CtlError,
    display,
    display_data,
    display_note,
    display_source,
    display_table,
    format_option,
    list_options,
    make_table,
    sections,
    select,
)

PREVIEW_MAX_BYTES = 64 << 20  # `show` fetches values only up to this size unless --values


def load_tensors(ctl: Ctl) -> list[Tensor]:
    """The tensors, in natural order of their names (t2 before t10)."""
    return sorted((Tensor.from_raw(r) for r in ctl.source().query("tensors")), key=lambda t: natural_key(t.name))


GROUP_BY = ("owner", "node", "kind", "dtype")


def find_tensor(ctl: Ctl, name: str) -> Tensor:
    for t in load_tensors(ctl):
        if t.name == name:
            return t
    if ctl.kv:
        from deepxd.kv.base import redact

        where = f"the storage plane at {redact(ctl.kv)}"  # never a password (docs/storage.md)
    else:
        where = f"deepxd at {ctl.address}"
    raise CtlError(f"no tensor named {name!r} in {where}; `deepxctl tensors ls` lists them")


@click.group()
def tensors() -> None:
    """Heap and stack tensors: list, show (metadata and values), remove."""


@tensors.command("ls")
@list_options
@click.option("--group-by", "group_by", type=click.Choice(GROUP_BY), default=None,
              help="One table per owner (the session that made the tensors; or per node, kind, dtype), largest "
                   "first, each with its count and bytes.")
@click.pass_obj
def ls(ctl: Ctl, fmt: str, filters: tuple[str, ...], limit: int, detail: bool, group_by: str | None) -> None:
    """List tensors, names in natural order (t2 before t10): name, kind (heap or stack), dtype, shape, bytes,
    owner (the session that made it, as client[pid]@host), parameter (a model parameter's module path), call site
    (the user's line that made it), node.

    \b
      deepxctl tensors ls --filter kind=heap --detail     # with refcount, holders, segment, client, pid, host
      deepxctl tensors ls --format json --filter pid=4242
      deepxctl tensors ls --group-by owner
    """
    rows = select(load_tensors(ctl), Tensor, filters, limit)
    if group_by is None:
        display_table(rows, Tensor, fmt=fmt, detail=detail)
        return
    groups: dict[str, list[Tensor]] = {}
    for t in rows:
        groups.setdefault(str(getattr(t, group_by)), []).append(t)
    ordered = sorted(groups.items(), key=lambda g: (-sum(t.bytes for t in g[1]), natural_key(g[0])))
    display_source()
    if fmt != "table":
        display_data([{group_by: key, "tensors": len(ts), "bytes": sum(t.bytes for t in ts),
                       "rows": [t.to_dict(detail) for t in ts]} for key, ts in ordered], fmt)
        return
    if not rows:
        display_note("no tensors")
    display(sections([make_table(ts, Tensor, detail=detail, title=f"{group_by} {key}: {len(ts)} tensors, "
                                 f"{human_bytes(sum(t.bytes for t in ts))}") for key, ts in ordered]))


@tensors.command("show")
@click.argument("name")
@format_option
@click.option("--values/--no-values", "values", default=None,
              help=f"Fetch the values for a preview (default: when the tensor is at most "
                   f"{human_bytes(PREVIEW_MAX_BYTES)}).")
@click.pass_obj
def show(ctl: Ctl, name: str, fmt: str, values: bool | None) -> None:
    """A tensor's metadata and a preview of its values.

    \b
      deepxctl tensors show w1
      deepxctl tensors show w1 --format json     # metadata, preview text and min/max/mean
    """
    t = find_tensor(ctl, name)
    preview: dict[str, Any] = {"preview": None, "stats": None, "note": ""}
    if ctl.kv:
        preview["note"] = "values need a running deepxd (the storage plane holds metadata only)"
    elif t.state not in ("", "live"):
        preview["note"] = f"no values: the tensor is {t.state}"
    elif values is False or (values is None and t.bytes > PREVIEW_MAX_BYTES):
        preview["note"] = f"values not fetched ({human_bytes(t.bytes)}); add --values to fetch them"
    else:
        preview.update(_preview(ctl, name))
    display_source()
    if fmt != "table":
        display_data({**t.to_dict(detail=True), **preview}, fmt)
        return
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for f in Tensor.columns(detail=True):
        if t.cell(f):  # a stack tensor has no refcount, holders or segment
            grid.add_row(Tensor.header(f).lower(), Cell(t.cell(f), max_lines=None))  # all of it, wrapped at separators
    stats = preview["stats"]
    if stats:
        grid.add_row("values", "  ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in stats.items()))
    display(grid)
    if preview["preview"] is not None:
        click.echo(preview["preview"])
    if preview["note"]:
        display_note(preview["note"])


def _preview(ctl: Ctl, name: str) -> dict[str, Any]:
    import numpy as np

    from deepx_core.errors import DeepxError

    try:
        a = ctl.daemon("tensor values").client.fetch(name)[name]
    except DeepxError as e:
        return {"note": f"values unavailable: {e}"}
    text = np.array2string(a, threshold=64, edgeitems=3, max_line_width=100)
    stats: dict[str, Any] = {"numel": int(a.size)}
    if a.size:
        try:
            f = a.astype(np.float64)  # ml_dtypes' bfloat16 and float8 convert too
        except (TypeError, ValueError):
            f = None
        if f is not None:
            finite = f[np.isfinite(f)]
            stats.update({"min": float(finite.min()) if finite.size else None,
                          "max": float(finite.max()) if finite.size else None,
                          "mean": float(finite.mean()) if finite.size else None,
                          "nonfinite": int(f.size - finite.size)})
    return {"preview": text, "stats": stats}


@tensors.command("rm")
@click.argument("name")
@click.option("--force", is_flag=True, help="Free a heap tensor even while others still hold references to it.")
@format_option
@click.pass_obj
def rm(ctl: Ctl, name: str, force: bool, fmt: str) -> None:
    """Free a tensor. A heap tensor held by more than one reference is refused unless --force (its holders are
    named, so you can ask them to release it first).

    \b
      deepxctl tensors rm activations
      deepxctl tensors rm w1 --force
    """
    d = ctl.daemon("tensors rm")
    info = d.client.request("delete", name=name, force=force)["tensor"]
    if fmt != "table":
        display_data(info, fmt)
        return
    click.echo(f"deleted {info['kind']} tensor {info['name']!r} ({human_bytes(info['bytes'])}) on node "
               f"{info['node']}{' (forced)' if info.get('forced') else ''}")


@tensors.command("share")
@click.argument("names", nargs=-1, required=True)
@click.option("--revoke", is_flag=True, help="Take the tensors back: UDP clients can no longer name them.")
@format_option
@click.pass_obj
def share(ctl: Ctl, names: tuple[str, ...], revoke: bool, fmt: str) -> None:
    """Share tensors with deepxIR's UDP clients, who otherwise reach only the tensors UDP made (UDP carries no
    credentials: docs/daemon.md, "who can do what").

    \b
      deepxctl tensors share w1 b1
      deepxctl tensors share w1 --revoke
    """
    d = ctl.daemon("tensors share")
    reply = d.client.request("udp_share", names=list(names), shared=not revoke)
    if fmt != "table":
        display_data({"names": reply["names"], "shared": reply["shared"]}, fmt)
        return
    listed = ", ".join(repr(n) for n in reply["names"])
    click.echo(f"{'shared with' if reply['shared'] else 'taken back from'} UDP clients: {listed}")
