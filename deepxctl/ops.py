"""deepxctl ops: per worker, each op's calls, mean and total time, and throughput (from the op counters the
registry writes to the storage plane every heartbeat)."""

from __future__ import annotations

import click

from deepxctl.context import Ctl
from deepxctl.schema import Op, OpEntry
from deepxctl.term import display_table, list_options, select


def load_ops(ctl: Ctl) -> list[Op]:
    return [Op.from_raw(r) for r in ctl.source().query("ops")]


@click.group()
def ops() -> None:
    """Op statistics per worker (which ops are slow, which are busy), and the catalogue of ops there are."""


@ops.command("ls")
@list_options
@click.pass_obj
def ls(ctl: Ctl, fmt: str, filters: tuple[str, ...], limit: int, detail: bool) -> None:
    """List ops by total time, busiest first: calls, mean time per call, total time, throughput (bytes written
    per second of op time). Counters reach the plane once per heartbeat, so a run shows up within heartbeat_s.

    \b
      deepxctl ops ls --limit 10
      deepxctl ops ls --filter worker=op-cpu --format json
    """
    rows = sorted(load_ops(ctl), key=lambda o: (-o.total_s, o.node, o.worker, o.op))
    display_table(select(rows, Op, filters, limit), Op, fmt=fmt, detail=detail)


@ops.command("catalogue")
@list_options
def catalogue(fmt: str, filters: tuple[str, ...], limit: int, detail: bool) -> None:
    """Every op deepx knows (its catalogue: no daemon asked): signature, dtypes, whether it is differentiable, and
    what it does; --detail adds the kernel family, whether it is one of deepxIR's 60 and its expression.

    \b
      deepxctl ops catalogue
      deepxctl ops catalogue --filter name=matmul --detail
      deepxctl ops catalogue --filter grad=false --format json
    """
    from deepx_core.ir.ops import OPS

    rows = [OpEntry(name=o.name, signature=o.signature(), dtypes=sorted(o.dtypes), grad=o.differentiable, doc=o.doc,
                    family=o.family, deepxir=o.deepxir, expr=o.expr)
            for o in sorted(OPS.values(), key=lambda o: o.name)]
    display_table(select(rows, OpEntry, filters, limit), OpEntry, fmt=fmt, detail=detail)
