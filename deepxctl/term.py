"""The terminal wrapper every command goes through, so that all of them look the same: tables (rich), JSON or YAML
on stdout, notes and errors on stderr, and the list options (--format, --filter, --limit, --detail).

rich, json and yaml are imported inside the functions: importing this module costs only click.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from deepxctl.schema import Schema

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

FORMATS = ("table", "json", "yaml")
DEFAULT_LIMIT = 100
WIDE = 240  # the width of tables written to a pipe or a file, where nothing wraps them
WIDEST = 1 << 20  # --wide: tables are measured against this, so nothing is cut short
CELL_LINES = 3  # a table cell wraps onto at most this many lines; the last ends in '…' when more was left out
SHORT_COLUMN = 24  # a word up to this long keeps its column at least that wide while others give way (FitTable)
WIDE_KEY = "deepxctl.wide"  # where --wide is kept: click's context meta, which subcommands share

F = TypeVar("F", bound=Callable[..., Any])
S = TypeVar("S", bound=Schema)


class CtlError(click.ClickException):
    """A refusal shown as one line on stderr, with exit code 1 (2 for a bad option, such as a bad --filter)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(" ".join(str(message).split()))
        self.exit_code = exit_code

    def show(self, file: Any = None) -> None:
        display_error(self.format_message())


@functools.cache
def _console_class() -> type[Console]:
    from rich.console import Console

    class CtlConsole(Console):
        def on_broken_pipe(self) -> None:
            """rich's own exits 1; the reader leaving is no error, and cli.CliGroup exits 0 with nothing said."""
            self.quiet = True
            raise BrokenPipeError

    return CtlConsole


def console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr); a terminal's width is its own (or $COLUMNS), and written to a pipe or a
    file it is WIDE, so that little wraps (execnet and others set COLUMNS=80 for processes with no terminal)."""
    stream = sys.stderr if stderr else sys.stdout
    c = _console_class()(file=stream, highlight=False)
    if not c.is_terminal:
        c = _console_class()(file=stream, highlight=False, width=WIDE, soft_wrap=True)
    return c


def wide_output() -> bool:
    """Whether --wide (or DEEPXCTL_WIDE) asked for whole cells, one line each, however wide the table gets."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get(WIDE_KEY))


def wide_option(f: F) -> F:
    """--wide: tables show every cell whole on one line (no wrapping, no '…'), as wide as that makes them."""

    def keep(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
        if value:
            ctx.meta[WIDE_KEY] = True
        return value

    return click.option("--wide", is_flag=True, envvar="DEEPXCTL_WIDE", expose_value=False, callback=keep,
                        help="Show every table cell whole, on one line, however wide the table gets (default: "
                             f"fit the terminal, wrapping cells at separators onto at most {CELL_LINES} lines "
                             "and ending cut ones with '…').")(f)


# a cell's pieces: a run of spaces, or a word up to and including its separators ('/', '_', '.', ',', and '[' and '@'
# of an owner's `train.py[4242]@gpu-1`; not '-', which joins words such as op-cpu); a URL's scheme stays with what
# follows it (never `udp://` alone at a line's end)
_PIECES = re.compile(r"\s+|(?:[^\s/_.,\[@]+://)?[^\s/_.,\[@]*[/_.,\[@]+|[^\s/_.,\[@]+")


def wrap_cell(text: str, width: int, max_lines: int | None = CELL_LINES, tail: bool = False) -> list[str]:
    """`text` as lines of at most `width` cells, broken at spaces and after separators ('/', '_', '.', ',', '[', '@'), a
    word longer than a line folded; beyond `max_lines` lines (None: no limit) the last kept line ends in '…', or with
    `tail` the last lines are kept and the first begins with '…' (a path's file and line matter most)."""
    from rich.cells import cell_len, chop_cells

    width = max(width, 1)
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for piece in _PIECES.findall(paragraph):
            if piece.isspace():
                if line and cell_len(line) + cell_len(piece) < width:
                    line += piece
                elif line:  # a full line breaks here, and the spaces go
                    lines.append(line)
                    line = ""
                continue
            if cell_len(line) + cell_len(piece) <= width:
                line += piece
                continue
            if line:
                lines.append(line.rstrip())
            *folded, line = chop_cells(piece, width)  # a word longer than a line: nothing else fits it
            lines.extend(folded)
        lines.append(line.rstrip())
    if max_lines is not None and len(lines) > max_lines and tail:
        lines = lines[-max_lines:]
        first = lines[0]
        while first and cell_len(first) + 1 > width:
            first = first[1:]
        lines[0] = "…" + first
    elif max_lines is not None and len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and cell_len(last) + 1 > width:
            last = last[:-1]
        lines[-1] = last + "…"
    return lines


class Cell:
    """A table cell: text a client gave (never markup), wrapped by wrap_cell at the column's width; with `wide`,
    whole on one line, and its column as wide as that needs."""

    def __init__(self, text: str, *, max_lines: int | None = CELL_LINES, wide: bool = False,
                 tail: bool = False) -> None:
        self.text = text
        self.max_lines = max_lines
        self.wide = wide
        self.tail = tail  # cut short, it keeps its end (wrap_cell)

    def __rich_measure__(self, console: Console, options: Any) -> Any:
        from rich.cells import cell_len
        from rich.measure import Measurement

        whole = max(cell_len(line) for line in self.text.split("\n"))
        if self.wide:
            return Measurement(whole, whole)
        longest = max((cell_len(p) for p in _PIECES.findall(self.text)), default=0)
        return Measurement(min(longest, whole), whole)

    def __rich_console__(self, console: Console, options: Any) -> Any:
        from rich.text import Text

        lines = (self.text.split("\n") if self.wide
                 else wrap_cell(self.text, options.max_width, self.max_lines, self.tail))
        yield Text("\n".join(lines), no_wrap=True, overflow="ignore" if self.wide else "ellipsis")


def display_error(message: str) -> None:
    """One line on stderr: `Error: <message>` (red on a terminal)."""
    if sys.stderr.isatty():
        from rich.markup import escape

        console(stderr=True).print(f"[bold red]Error:[/] {escape(message)}", soft_wrap=True)
    else:
        click.echo(f"Error: {message}", err=True)


def display_note(message: str) -> None:
    """A remark on stderr that does not belong in the output (stdout stays parseable)."""
    if sys.stderr.isatty():
        from rich.markup import escape

        console(stderr=True).print(f"[dim]{escape(message)}[/]", soft_wrap=True)
    else:
        click.echo(message, err=True)


def display_text(text: str) -> None:
    click.echo(text)


def display(renderable: RenderableType) -> None:
    """A renderable on stdout; with --wide, the console is made as wide as the renderable's widest line. Columns a
    narrow terminal left out (FitTable) are named in a note."""
    c = console()
    if wide_output():
        from rich.measure import Measurement

        c.width = max(c.width, Measurement.get(c, c.options.update_width(WIDEST), renderable).maximum)
    _LEFT_OUT.clear()
    if c.is_terminal:
        c.print(renderable)
    else:
        with c.capture() as captured:  # a pipe or a file: the same text without the cells' trailing padding
            c.print(renderable)
        click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))
    if _LEFT_OUT:
        display_note(f"left out to fit {c.width} columns: {', '.join(_LEFT_OUT)} (--wide or --format json shows "
                     "every column)")


_LEFT_OUT: dict[str, None] = {}  # the headers of the columns the tables just drawn left out, in order


def sections(parts: Sequence[Any]) -> Any:
    """Renderables one under the other, a blank line between them."""
    from rich.console import Group

    spaced: list[Any] = []
    for part in parts:
        spaced.extend(("", part) if spaced else (part,))
    return Group(*spaced)


def make_table(rows: Sequence[Schema], cls: type[Schema], *, detail: bool = False, title: str | None = None,
               first_header: str | None = None) -> Any:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    # titles are deepxctl's own; cells are what clients named (a tensor's owner, a graph's instructions): plain text,
    # never rich markup ('[/x]' in an owner raised, '[red]alice' printed red)
    table = Table(title=Text(title, style="bold") if title is not None else None, box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, title_justify="left")
    columns = cls.columns(detail)
    for i, f in enumerate(columns):
        table.add_column(first_header if i == 0 and first_header else cls.header(f),
                         justify="right" if f.metadata.get("right") else "left")
    wide = wide_output()
    for r in rows:
        table.add_row(*(Cell(r.cell(f), max_lines=None if f.metadata.get("whole") else CELL_LINES, wide=wide,
                             tail=bool(f.metadata.get("tail"))) for f in columns))
    # the columns a narrow terminal leaves out, the rightmost first
    spare = [table.columns[i] for i, f in reversed(list(enumerate(columns))) if f.metadata.get("spare")]
    return FitTable(table, () if wide else spare)


def fit_widths(natural: Sequence[int], floors: Sequence[int], room: int) -> list[int]:
    """Column widths within `room`: the widest give way first, none below its floor (its longest word, at most
    SHORT_COLUMN) while the floors fit; where they do not, the narrowest keep theirs and the rest share what is
    left."""
    if sum(natural) <= room:
        return list(natural)
    if sum(floors) > room:
        out, left, remaining = list(natural), len(natural), room
        for i in sorted(range(len(natural)), key=natural.__getitem__):
            out[i] = max(1, min(natural[i], remaining // left))
            remaining, left = remaining - out[i], left - 1
        return out
    lo, hi = 0, max(natural)  # the largest level L at which min(natural, max(floor, L)) fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, max(f, mid)) for n, f in zip(natural, floors, strict=True)) <= room:
            lo = mid
        else:
            hi = mid - 1
    out = [min(n, max(f, lo)) for n, f in zip(natural, floors, strict=True)]
    spare = room - sum(out)
    for i in sorted(range(len(out)), key=lambda i: -natural[i]):  # what the level left over, to the widest cut
        if spare and out[i] < natural[i]:
            out[i], spare = out[i] + 1, spare - 1
    return out


class FitTable:
    """A rich Table whose column widths are chosen when it is drawn, at the width it gets (fit_widths): the widest
    columns (a 300-character name) give way first and a short word (a node id, `running`) is not broken while
    there is room for it. rich's own choice narrowed every wide column alike and folded words mid-way."""

    def __init__(self, table: Any, spare: Sequence[Any] = ()) -> None:
        self.table = table
        self.spare = list(spare)  # columns left out, in this order, while the others' words do not fit

    def _measure(self, console: Console, options: Any) -> tuple[list[int], list[int], int]:
        """Each column's widest cell or header, its longest word (at most SHORT_COLUMN), and the table's width
        beyond the columns' (padding, separators)."""
        from rich.measure import Measurement

        natural, floors = [], []
        unbounded = options.update_width(WIDEST)
        for column in self.table.columns:
            column.width = None
            sizes = [Measurement.get(console, unbounded, cell) for cell in (column.header, *column.cells)]
            natural.append(max(m.maximum for m in sizes))
            floors.append(min(max(m.minimum for m in sizes), SHORT_COLUMN, natural[-1]))
        whole = Measurement.get(console, unbounded, self.table).maximum
        return natural, floors, whole - sum(natural)

    def _crowded(self, natural: list[int], floors: list[int], extra: int, room: int) -> bool:
        """Whether the other columns' short words (up to SHORT_COLUMN) would be cut, with the spare columns at
        their longest words: a spare column then goes first."""
        spare = {id(c) for c in self.spare}
        need = sum(f if id(c) in spare else min(n, SHORT_COLUMN)
                   for c, n, f in zip(self.table.columns, natural, floors, strict=True))
        return need + extra > room

    def __rich_measure__(self, console: Console, options: Any) -> Any:
        from rich.measure import Measurement

        natural, _floors, extra = self._measure(console, options)
        return Measurement(min(sum(natural) + extra, options.max_width), sum(natural) + extra)

    def __rich_console__(self, console: Console, options: Any) -> Any:
        natural, floors, extra = self._measure(console, options)
        while self.spare and self._crowded(natural, floors, extra, options.max_width):
            column = self.spare.pop(0)
            self.table.columns.remove(column)
            _LEFT_OUT.setdefault(str(column.header), None)
            natural, floors, extra = self._measure(console, options)
        widths = fit_widths(natural, floors, options.max_width - extra)
        if widths != natural:
            for column, w in zip(self.table.columns, widths, strict=True):
                column.width = w
        yield self.table


def display_source() -> None:
    """Which daemon (node, pid, socket) or plane answered, as a note above a listing: another process's daemon can
    own the default socket. A note (stderr), so that stdout stays the table or the JSON/YAML list."""
    ctx = click.get_current_context(silent=True)
    answered_by = getattr(ctx.obj if ctx is not None else None, "answered_by", "")
    if answered_by:
        display_note(f"from {answered_by}")


def display_table(rows: Sequence[Schema], cls: type[Schema], *, fmt: str = "table", detail: bool = False,
                  title: str | None = None) -> None:
    """A list of objects of one schema: a table, or a JSON/YAML list of the same fields, under display_source's
    note."""
    display_source()
    if fmt != "table":
        display_data([r.to_dict(detail) for r in rows], fmt)
        return
    if not rows:
        display_note(f"no {cls.object_name}")
    display(make_table(rows, cls, detail=detail, title=title))


def display_data(data: Any, fmt: str) -> None:
    """Plain data (dicts, lists, numbers, strings) as JSON or YAML."""
    if fmt == "json":
        import json

        click.echo(json.dumps(data, indent=2, default=_jsonable))
    else:
        import yaml

        click.echo(yaml.safe_dump(_plain(data), sort_keys=False, allow_unicode=True).rstrip("\n"))


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v).hex()
    if hasattr(v, "tolist"):
        return v.tolist()
    return str(v)


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return _jsonable(v)


# -- the list options

def list_options(f: F) -> F:
    """--format, --filter, --limit, --detail and --wide, as every list command takes them."""
    f = wide_option(f)
    f = click.option("--detail", is_flag=True, help="Show every field, not only the main columns.")(f)
    f = click.option("--limit", type=click.IntRange(min=1), default=DEFAULT_LIMIT, show_default=True,
                     help="Show at most N rows.")(f)
    f = click.option("--filter", "filters", multiple=True, metavar="KEY=VALUE",
                     help="Keep rows whose field KEY equals VALUE (KEY!=VALUE: differs); repeatable, all must hold.")(f)
    return format_option(f)


def format_option(f: F) -> F:
    return click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                        help="Output format.")(f)


def parse_filters(filters: Sequence[str], cls: type[Schema]) -> list[tuple[str, bool, str]]:
    """`key=value` / `key!=value` as (key, equal, value); CtlError (exit 2) for anything else or an unknown key."""
    known = cls.field_names()
    out = []
    for text in filters:
        key, eq, value = text.partition("=")
        equal = not key.endswith("!")
        key = key.removesuffix("!").strip()
        if not eq or not key:
            raise CtlError(f"bad --filter {text!r}: expected KEY=VALUE or KEY!=VALUE, e.g. --filter kind=heap",
                           exit_code=2)
        if key not in known:
            raise CtlError(f"bad --filter {text!r}: {cls.object_name} have no field {key!r}; known: "
                           f"{', '.join(known)}", exit_code=2)
        out.append((key, equal, value.strip()))
    return out


def filter_text(v: Any) -> str:
    """A value as --filter compares it: lists as `a,b`, maps as `k=v,...`, booleans as true/false."""
    if isinstance(v, list | tuple):
        return ",".join(map(filter_text, v))
    if isinstance(v, Mapping):
        return ",".join(f"{k}={filter_text(x)}" for k, x in v.items())
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


def _matches(field: Any, value: str) -> bool:
    if isinstance(field, list | tuple):  # shape=2,3 and shape=[2, 3] alike
        value = value.strip().removeprefix("[").removesuffix("]").replace(" ", "")
    return filter_text(field) == value


def select(rows: Sequence[S], cls: type[S], filters: Sequence[str], limit: int | None) -> list[S]:
    """Rows that pass every filter, at most `limit` of them (a note on stderr says when some were left out)."""
    preds = parse_filters(filters, cls)
    kept = [r for r in rows if all(_matches(getattr(r, k), v) == eq for k, eq, v in preds)]
    if limit is not None and len(kept) > limit:
        display_note(f"showing {limit} of {len(kept)} {cls.object_name}; use --limit to see more")
        kept = kept[:limit]
    return kept


def fail(message: str, exit_code: int = 1) -> NoReturn:
    raise CtlError(message, exit_code)
