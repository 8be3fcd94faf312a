"""deepxctl executors: the executors of other processes registered with the daemon at --address (docs/executor.md)."""

from __future__ import annotations

import click

from deepxctl.context import Ctl
from deepxctl.schema import ExecutorRow
from deepxctl.term import display_table, list_options, select


def load_executors(ctl: Ctl) -> list[ExecutorRow]:
    return [ExecutorRow.from_raw(r) for r in ctl.daemon("executors").query("executors")]


@click.group()
def executors() -> None:
    """Executors of other processes that serve ops to the daemon: who they are, their ops and costs."""


@executors.command("ls")
@list_options
@click.pass_obj
def ls(ctl: Ctl, fmt: str, filters: tuple[str, ...], limit: int, detail: bool) -> None:
    """List executors: pid, the ops each serves with its cost (microseconds a call), instructions run, errors
    (--detail: where it connected from, its host, whether it maps this host's shared memory, since when). The JSON
    form gives each op's signature, whether the executor declared it, its calls and mean time.

    \b
      deepxctl executors ls
      deepxctl executors ls --format json
    """
    display_table(select(load_executors(ctl), ExecutorRow, filters, limit), ExecutorRow, fmt=fmt, detail=detail)
