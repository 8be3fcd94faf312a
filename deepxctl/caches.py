"""deepxctl caches: every cache of a daemon's process, with its size and hit rate (deepx_core.cache)."""

from __future__ import annotations

import click

from deepxctl.context import Ctl
from deepxctl.schema import CacheRow
from deepxctl.term import display_table, list_options, select


@click.group()
def caches() -> None:
    """The daemon's caches: plans, rewrites, derived backwards, compiled kernels. Whether a training loop's
    steps repeat shows here: its caches' hit rates climb towards 100%."""


@caches.command("ls")
@list_options
@click.pass_obj
def ls(ctl: Ctl, fmt: str, filters: tuple[str, ...], limit: int, detail: bool) -> None:
    """List the caches of the daemon's process by name: items held and capacity (the least recently used go past
    it), hits, misses, hit rate and evictions since the daemon started. Interning tables (the wire's, the parser's)
    count only what they made: their HITS and HIT RATE are empty. Needs a running daemon (not --kv).

    \b
      deepxctl caches ls
      deepxctl caches ls --filter cache=scheduler.plans --format json
    """
    rows = sorted((CacheRow.from_raw(r) for r in ctl.daemon("caches ls").query("caches")),
                  key=lambda c: (c.cache, c.owner))
    display_table(select(rows, CacheRow, filters, limit), CacheRow, fmt=fmt, detail=detail)
