"""deepxctl actors: the actors of the daemon at --address and how their mailboxes are doing."""

from __future__ import annotations

import click

from deepxctl.context import Ctl
from deepxctl.schema import Actor
from deepxctl.term import display_table, list_options, select


def load_actors(ctl: Ctl) -> list[Actor]:
    return [Actor.from_raw(r) for r in ctl.daemon("actors").query("actors")]


@click.group()
def actors() -> None:
    """The daemon's actors (one per role): alive, busy, failing?"""


@actors.command("ls")
@list_options
@click.pass_obj
def ls(ctl: Ctl, fmt: str, filters: tuple[str, ...], limit: int, detail: bool) -> None:
    """List actors: role, state, the message each is handling now and for how long, mailbox depth, messages
    handled, errors, restarts (--detail: busy time, last error). A growing mailbox is a backlog; restarts mean the
    actor crashed and its supervisor restarted it.

    \b
      deepxctl actors ls
      deepxctl actors ls --filter state!=running
    """
    display_table(select(load_actors(ctl), Actor, filters, limit), Actor, fmt=fmt, detail=detail)
