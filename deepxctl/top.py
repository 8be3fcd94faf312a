"""deepxctl top: a live view of one daemon, refreshed in place: the busiest ops, memory by kind, actor mailboxes."""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from deepxctl.context import Ctl, DaemonSource
from deepxctl.memory import summarize
from deepxctl.schema import Actor, Op, Tensor, Usage, human_bytes
from deepxctl.term import console, display, make_table, sections, wide_option


class TopView:
    """Frames of `top`. After the first frame the op table covers the last interval (calls, time and throughput
    since the previous frame); the first covers everything since the daemon started."""

    def __init__(self, daemon: DaemonSource, rows: int) -> None:
        self.daemon = daemon
        self.rows = rows
        self.previous: dict[tuple[str, str, str], Op] | None = None
        self.previous_at = 0.0

    def busiest(self, ops: list[Op]) -> tuple[list[Op], str]:
        now = time.monotonic()
        current = {(o.node, o.worker, o.op): o for o in ops}
        if self.previous is None:
            shown, title = ops, "busiest ops since start"
        else:
            shown = []
            for key, o in current.items():
                before = self.previous.get(key)
                calls = o.calls - (before.calls if before else 0)
                if calls <= 0:
                    continue
                total = o.total_s - (before.total_s if before else 0.0)
                nbytes = o.bytes - (before.bytes if before else 0)
                shown.append(Op(o.node, o.worker, o.op, calls, total / calls * 1e6, total,
                                nbytes / total if total > 0 else 0.0, nbytes))
            title = f"busiest ops in the last {now - self.previous_at:.1f} s"
        self.previous, self.previous_at = current, now
        shown.sort(key=lambda o: (-o.total_s, -o.calls, o.op))
        return shown[: self.rows], title

    def data(self) -> dict[str, Any]:
        """One frame's content, as `--format json` prints it (and the table view shows it)."""
        d = self.daemon
        ops = [Op.from_raw(r) for r in d.query("ops")]
        tensors = [Tensor.from_raw(r) for r in d.query("tensors")]
        actors = [Actor.from_raw(r) for r in d.query("actors")]
        report = summarize(tensors, d.heapmem())
        busiest, title = self.busiest(ops)
        actors.sort(key=lambda a: (-a.mailbox, a.name))
        return {"node": d.node, "pid": d.client.server.get("pid"), "address": d.address,
                "roles": list(d.client.server.get("roles") or []), "time": time.time(),
                "total_bytes": report["total_bytes"], "tensors": report["tensors"], "ops_title": title,
                "ops": [o.to_dict(detail=True) for o in busiest], "by_kind": report["by_kind"],
                "heapmem": report["heapmem"], "actors": [a.to_dict(detail=True) for a in actors]}

    def frame(self) -> Any:
        from rich.markup import escape

        f = self.data()
        head = (f"[bold]deepxctl top[/]  node [bold]{escape(str(f['node']))}[/] ({escape(','.join(f['roles']))})  "
                f"pid {f['pid']}  {escape(f['address'])}  {time.strftime('%H:%M:%S', time.localtime(f['time']))}  "
                f"{human_bytes(f['total_bytes'])} in {f['tensors']} tensors")
        parts: list[Any] = [head, make_table([Op(**o) for o in f["ops"]], Op, title=f["ops_title"])]
        parts.append(make_table([Usage(**u) for u in f["by_kind"]], Usage, title="memory by kind",
                                first_header="KIND"))
        pool = f["heapmem"]
        if pool:
            parts.append(f"heapmem: {pool.get('segments', 0)} segments, {human_bytes(pool.get('segment_bytes', 0))} "
                         f"mapped, {pool.get('lost', 0)} lost; pool {human_bytes(pool.get('pooled_bytes', 0))} of "
                         f"{human_bytes(pool.get('pool_limit', 0))}")
        parts.append(make_table([Actor(**a) for a in f["actors"]], Actor, title="actors (deepest mailbox first)"))
        return sections(parts)


@click.command()
@click.option("--interval", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Render one frame and exit (for scripts and logs).")
@click.option("-n", "--iterations", type=click.IntRange(min=1), default=None,
              help="Exit after N frames (default: run until Ctrl-C).")
@click.option("--rows", type=click.IntRange(min=1), default=10, show_default=True, help="Ops to show.")
@click.option("--format", "fmt", type=click.Choice(("table", "json")), default="table", show_default=True,
              help="json: each frame as one JSON object on a line of its own (JSON Lines).")
@wide_option
@click.pass_obj
def top(ctl: Ctl, interval: float, once: bool, iterations: int | None, rows: int, fmt: str) -> None:
    """A live view of the daemon, refreshed in place: the busiest ops (over the last interval), memory by kind
    and heapmem's pool, and the actors by mailbox depth. Ctrl-C quits.

    \b
      deepxctl top
      deepxctl top --interval 0.5
      deepxctl top --once
      deepxctl top --format json -n 10 > frames.jsonl
    """
    view = TopView(ctl.daemon("top"), rows)
    out = console()
    try:
        if fmt == "json":
            import json

            for shown in range(1 if once else iterations or sys.maxsize):
                if shown:
                    time.sleep(interval)
                click.echo(json.dumps(view.data()))
        elif once:
            display(view.frame())
        elif not out.is_terminal:  # a pipe or a file: the frames one after another, as `top -b` writes them
            for shown in range(iterations or sys.maxsize):
                if shown:
                    time.sleep(interval)
                    click.echo()
                display(view.frame())
        else:
            from rich.live import Live

            with Live(view.frame(), console=out, auto_refresh=False) as live:
                for _ in range((iterations or sys.maxsize) - 1):
                    time.sleep(interval)
                    live.update(view.frame(), refresh=True)
    except KeyboardInterrupt:
        pass
