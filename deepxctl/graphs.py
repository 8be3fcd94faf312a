"""deepxctl graphs: the programs stored in the storage plane (`graph:<name>`: msgpack {"v": 1, "instrs": [...]}),
listed, and shown as deepxIR text before and after the compiler passes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from deepxctl.context import Ctl
from deepxctl.schema import Graph
from deepxctl.term import CtlError, display_data, display_note, display_table, format_option, list_options, select

if TYPE_CHECKING:
    from deepx_sdk.ir.instr import Instr

# the passes `graphs show` applies, in order, as (name, program -> program); none exist yet, so a program shows
# unchanged after them
PASSES: Sequence[tuple[str, Callable[[list[Instr]], list[Instr]]]] = ()


def decode(raw: dict[str, Any]) -> tuple[Graph, list[Instr]]:
    """A stored graph's row and its instructions ([] with `error` set when it does not decode)."""
    from deepx_sdk.errors import DeepxError
    from deepx_sdk.ir.wire import unpack_program

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
@format_option
@click.pass_obj
def show(ctl: Ctl, name: str, fmt: str) -> None:
    """A stored graph as deepxIR text, before and after the passes.

    \b
      deepxctl graphs show mlp
      deepxctl graphs show mlp --format json
    """
    from deepx_sdk.ir.text import format_text

    found = [(g, instrs) for g, instrs in load_graphs(ctl) if g.name == name]
    if not found:
        raise CtlError(f"no graph named {name!r} in {ctl.source().where}; `deepxctl graphs ls` lists them")
    g, instrs = found[0]
    if g.error:
        raise CtlError(f"graph {name!r} does not decode: {g.error}")
    after = list(instrs)
    for _, run in PASSES:
        after = run(after)
    before_text = [format_text(i) for i in instrs]
    after_text = [format_text(i) for i in after]
    if fmt != "table":
        display_data({**g.to_dict(detail=True), "passes": [p for p, _ in PASSES], "before": before_text,
                      "after": after_text}, fmt)
        return
    click.echo(f"graph {g.name}: {g.instructions} instructions, {g.bytes} bytes")
    click.echo("-- before the passes --")
    for line in before_text:
        click.echo(line)
    if not PASSES:
        display_note("-- after the passes: unchanged (no compiler passes exist yet) --")
        return
    click.echo(f"-- after the passes ({', '.join(p for p, _ in PASSES)}) --")
    for line in after_text:
        click.echo(line)
