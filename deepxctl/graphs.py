"""deepxctl graphs: the programs stored in the storage plane (`graph:<name>`: msgpack {"v": 1, "instrs": [...]}, as
dx.compile writes them; docs/graphs.md), listed, and shown as deepxIR text, with `--passes` also as the daemon's
passes make it (the plan every replay of the graph runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from deepxctl.context import Ctl
from deepxctl.schema import Graph
from deepxctl.term import CtlError, display_data, display_note, display_table, format_option, list_options, select

if TYPE_CHECKING:
    from deepx_core.ir.instr import Instr


def decode(raw: dict[str, Any]) -> tuple[Graph, list[Instr]]:
    """A stored graph's row and its instructions ([] with `error` set when it does not decode)."""
    from deepx_core.errors import DeepxError
    from deepx_core.ir.wire import unpack_program

    data = raw.get("data")
    g = Graph(name=raw["name"], bytes=len(data) if data else 0, error=raw.get("error", ""))
    if data is None:
        return g, []
    try:
        instrs = unpack_program(bytes(data))
    except DeepxError as e:
        g.error = str(e)
        return g, []
    g.instructions = len(instrs)
    g.ops = list(dict.fromkeys(i.name for i in instrs))
    return g, instrs


def load_graphs(ctl: Ctl) -> list[tuple[Graph, list[Instr]]]:
    return sorted((decode(r) for r in ctl.source().query("graphs")), key=lambda gi: gi[0].name)


@click.group()
def graphs() -> None:
    """Stored programs (graph:<name> in the storage plane)."""


@graphs.command("ls")
@list_options
@click.pass_obj
def ls(ctl: Ctl, fmt: str, filters: tuple[str, ...], limit: int, detail: bool) -> None:
    """List stored graphs: name, instructions, bytes, the ops they use (--detail: why one does not decode).

    \b
      deepxctl graphs ls
      deepxctl graphs ls --format json
    """
    rows = select([g for g, _ in load_graphs(ctl)], Graph, filters, limit)
    display_table(rows, Graph, fmt=fmt, detail=detail)


@graphs.command("show")
@click.argument("name")
@click.option("--passes", "passes", is_flag=True,
              help="Also show the program after the compiler passes: the daemon's plan for it (what every replay "
                   "runs); with --kv, the passes run here, knowing only the graph's inputs.")
@format_option
@click.pass_obj
def show(ctl: Ctl, name: str, passes: bool, fmt: str) -> None:
    """A stored graph as deepxIR text (--passes: before and after the compiler passes).

    \b
      deepxctl graphs show train_step-3fa2c1d07be4
      deepxctl graphs show train_step-3fa2c1d07be4 --passes
      deepxctl graphs show mlp --passes --format json
    """
    from deepx_core.ir.text import format_text

    found = [(g, instrs) for g, instrs in load_graphs(ctl) if g.name == name]
    if not found:
        raise CtlError(f"no graph named {name!r} in {ctl.source().where}; `deepxctl graphs ls` lists them")
    g, instrs = found[0]
    if g.error:
        raise CtlError(f"graph {name!r} does not decode: {g.error}")
    before_text = [format_text(i) for i in instrs]
    after: dict[str, Any] | None = after_passes(ctl, name, instrs) if passes else None
    if after is not None and after.get("note"):
        display_note(after["note"])  # stderr, in every format
    if fmt != "table":
        extra = {"passes": after["passes"], "after": after["after"]} if after is not None else {}
        display_data({**g.to_dict(detail=True), "before": before_text, **extra}, fmt)
        return
    click.echo(f"graph {g.name}: {g.instructions} instructions, {g.bytes} bytes")
    if after is not None:
        click.echo("-- before the passes --")
    for line in before_text:
        click.echo(line)
    if after is None:
        return
    names = ", ".join(after["passes"]) or "none: the daemon runs with passes off"
    click.echo(f"-- after the passes ({names}): {len(after['after'])} instructions --")
    for line in after["after"]:
        click.echo(line)


@graphs.command("rm")
@click.argument("names", nargs=-1, required=True)
@format_option
@click.pass_obj
def rm(ctl: Ctl, names: tuple[str, ...], fmt: str) -> None:
    """Delete stored graphs: their records in the plane, and the daemon's plans of them with the temporaries their
    replays keep. A dx.compile'd function that replays one afterwards captures it again. Each run of a script
    stores its graphs under new names (its tensors' names are its own), so a plane that lives on (Redis, a
    persisted file) keeps them until they are deleted here.

    \b
      deepxctl graphs rm step-3f2a9c1d0b7e
      deepxctl graphs rm $(deepxctl graphs ls --format json | jq -r '.[].name')
    """
    d = ctl.daemon("graphs rm")
    done = [d.client.request("graph_rm", name=name) for name in names]
    if fmt != "table":
        display_data([{k: v for k, v in r.items() if k not in ("id", "ok")} for r in done], fmt)
        return
    for r in done:
        extra = f" (its plan and {r['temporaries_deleted']} kept temporaries dropped)" if r.get("plan_dropped") else ""
        click.echo(f"deleted graph {r['name']!r}{extra}")


def after_passes(ctl: Ctl, name: str, instrs: list[Instr]) -> dict[str, Any]:
    """{"passes", "after": [lines]} from the daemon's plan of the graph; under --kv, from the passes run here."""
    from deepx_core.errors import DeepxError

    if not ctl.kv:
        try:
            r = ctl.daemon("graphs show --passes").client.request("explain", graph=name)
        except DeepxError as e:
            raise CtlError(f"graphs show --passes: {e}") from None
        return {"passes": list(r["passes"]), "after": str(r["after"]).splitlines() if r["after"] else []}
    from deepx_core.graphrecord import GraphRecord
    from deepx_core.ir.ops import TensorMeta
    from deepx_core.ir.text import format_text
    from deepxd.compiler.pipeline import DEFAULT_PASSES, new_context, run_passes

    metas: dict[str, TensorMeta] = {}
    for raw in ctl.source().query("graphs"):
        if raw["name"] == name and raw.get("data") is not None:
            try:
                metas = {n: TensorMeta(tuple(s), d) for n, d, s in GraphRecord.unpack(bytes(raw["data"]), name).inputs}
            except DeepxError:
                pass
    after = run_passes(instrs, new_context(metas), DEFAULT_PASSES)
    return {"passes": list(DEFAULT_PASSES), "after": [format_text(i) for i in after],
            "note": "the passes ran here, knowing the graph's inputs but not the daemon's tensors (a program that "
                    "reads parameters stays as it is): drop --kv to see the daemon's plan"}
