"""deepxctl nodes: the daemons recorded in the storage plane, with their heartbeats."""

from __future__ import annotations

import click

from deepxctl.context import Ctl
from deepxctl.schema import Node
from deepxctl.term import display_table, list_options, select


@click.group()
def nodes() -> None:
    """Nodes (daemons) of the cluster: which are alive."""


@nodes.command("ls")
@list_options
@click.pass_obj
def ls(ctl: Ctl, fmt: str, filters: tuple[str, ...], limit: int, detail: bool) -> None:
    """List nodes: state, roles, addresses, heartbeat age, devices. A running node whose heartbeat is much older
    than its heartbeat_s has stopped without saying so.

    \b
      deepxctl nodes ls
      deepxctl nodes ls --filter state=running --detail
    """
    rows = sorted((Node.from_raw(r) for r in ctl.source().query("nodes")), key=lambda n: n.node)
    display_table(select(rows, Node, filters, limit), Node, fmt=fmt, detail=detail)
