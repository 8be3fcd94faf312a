"""Tables on narrow terminals (issue 27, item 6): cells wrap at separators, never mid-word where a separator is near,
onto a few lines ending in '…'; --wide shows every cell whole."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest
from click.testing import CliRunner

from deepxctl.cli import cli
from deepxctl.schema import Node
from deepxctl.term import CELL_LINES, WIDE, fit_widths, make_table, wrap_cell
from tests.daemon.conftest import Daemon

# 300 characters, with separators every few, as generated names have them
LONG = "_".join(f"layer{i:03d}.attn.q_proj" for i in range(14))[:300]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_wrap_breaks_after_separators_not_mid_word() -> None:
    # the address, which rich folded as `unix:///run/user/1000/de` / `epx/d.sock`
    assert wrap_cell("unix:///run/user/1000/deepx/deepxd.sock", 24) == ["unix:///run/user/1000/", "deepx/deepxd.sock"]
    assert wrap_cell("unix:///p/deepxd.sock udp://127.0.0.1:9090", 22) == ["unix:///p/deepxd.sock",
                                                                            "udp://127.0.0.1:9090"]
    assert wrap_cell("registry, heapmem, scheduler", 10) == ["registry,", "heapmem,", "scheduler"]
    assert wrap_cell("w1", 10) == ["w1"] and wrap_cell("", 10) == [""]


def test_wrap_breaks_an_owner_after_its_bracket_and_at() -> None:
    assert wrap_cell("train.py[26410]@gpu-node-1", 10) == ["train.py[", "26410]@", "gpu-node-1"]


def test_a_cut_call_site_keeps_its_file_and_line() -> None:
    site = "/home/someone/projects/deepx/experiments/2026/tests/test_model.py:123"
    assert wrap_cell(site, 14, tail=True) == ["…2026/tests/", "test_model.", "py:123"]
    assert wrap_cell(site, 14)[-1] == "deepx/…"  # what any other cell keeps: its start


def test_wrap_cuts_after_max_lines_with_an_ellipsis() -> None:
    lines = wrap_cell(LONG, 30)
    assert len(lines) == CELL_LINES and all(len(line) <= 30 for line in lines)
    assert lines[-1].endswith("…") and "".join(lines)[:-1] == LONG[: len("".join(lines)) - 1]
    assert "".join(wrap_cell(LONG, 30, max_lines=None)) == LONG  # no limit: all of it, wrapped
    assert wrap_cell("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]  # no separator: folded, as nothing else fits
    assert wrap_cell("x" * 35, 10) == ["x" * 10, "x" * 10, "x" * 9 + "…"]


def test_fit_widths_narrows_the_widest_first_and_keeps_short_words() -> None:
    assert fit_widths([300, 5, 20], [9, 5, 20], 50) == [25, 5, 20]  # the name gives way, the node id stays whole
    assert fit_widths([40, 40, 5], [10, 10, 5], 45) == [20, 20, 5]
    assert fit_widths([10, 5], [10, 5], 40) == [10, 5]  # room enough: unchanged
    assert sum(fit_widths([9, 9, 9, 9], [9, 9, 9, 9], 20)) <= 20  # even the words do not fit: all share


def test_a_table_fits_its_width_without_breaking_an_address() -> None:
    from rich.console import Console

    node = Node("gpu-1", "running", ["registry", "heapmem", "scheduler", "op-cpu"],
                {"unix": "unix:///run/user/1000/deepx/deepxd.sock", "udp": "127.0.0.1:9090"}, 0.05, ["cpu"])
    c = Console(width=80, file=None, highlight=False, color_system=None)
    with c.capture() as out:
        c.print(make_table([node], Node))
    lines = out.get().splitlines()
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    for piece in ("unix:///run/user/", "1000/", "deepx/", "deepxd.sock", "udp://127.", "op-cpu", "scheduler,"):
        assert piece in text, (piece, text)  # the columns share 80 characters, but no word is broken


@pytest.fixture(scope="module")
def long_named(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("narrow"), udp=False).start()
    with d.client() as c:
        c.put(LONG, np.zeros((2, 3), np.float32), heap=True, owner="alice")
        c.put("w1", np.ones(4, np.float32))
    yield d
    assert d.stop() == 0, d.output()


def run(d: Daemon, *args: str, columns: int | None = 80) -> str:
    """deepxctl's stdout, on an 80-column terminal (FORCE_COLOR: rich takes stdout for a terminal, and takes its
    width from COLUMNS, as in a shell), or in a pipe (columns=None); colours and styles removed."""
    env = {"FORCE_COLOR": "1", "COLUMNS": str(columns)} if columns else {"NO_COLOR": "1"}
    r = CliRunner().invoke(cli, ["--address", d.address, *args], env=env, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return ANSI.sub("", r.stdout)


@pytest.mark.parametrize("args", [["tensors", "ls"], ["tensors", "ls", "--detail"], ["memory"],
                                  ["tensors", "ls", "--group-by", "owner"]], ids=" ".join)
def test_at_80_columns_a_long_name_is_cut_with_an_ellipsis(long_named: Daemon, args: list[str]) -> None:
    out = run(long_named, *args)
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert LONG not in out.replace("\n", "") and "…" in out, out
    assert "w1" in out


def test_at_80_columns_the_name_takes_a_few_lines_not_hundreds(long_named: Daemon) -> None:
    lines = run(long_named, "tensors", "ls").splitlines()
    assert lines[2].startswith("layer000.") and long_named.node_id in lines[2]  # the node id stays whole
    first_of_w1 = next(i for i, line in enumerate(lines) if line.startswith("w1 "))
    assert first_of_w1 - 2 == CELL_LINES and lines[first_of_w1 - 1].split()[-1].endswith("…")


def test_at_80_columns_parameter_and_call_site_give_way_first(long_named: Daemon) -> None:
    """Spare columns are left out, with a note on stderr, before the others' short words are cut."""
    r = CliRunner().invoke(cli, ["--address", long_named.address, "tensors", "ls"],
                           env={"FORCE_COLOR": "1", "COLUMNS": "80"}, catch_exceptions=False)
    header = ANSI.sub("", r.stdout).splitlines()[0].split()
    assert header == ["NAME", "KIND", "DTYPE", "SHAPE", "BYTES", "OWNER", "NODE"]
    assert "left out to fit 80 columns: CALL SITE, PARAMETER (--wide" in ANSI.sub("", r.stderr)
    wide = run(long_named, "tensors", "ls", "--wide").splitlines()[0].split()
    assert wide[5:] == ["OWNER", "PARAMETER", "CALL", "SITE", "NODE"]
    assert run(long_named, "tensors", "ls", columns=130).splitlines()[0].split() == wide  # room for them


def test_wide_shows_the_name_whole(long_named: Daemon) -> None:
    for columns in (80, None):
        out = run(long_named, "tensors", "ls", "--wide", columns=columns)
        row = next(line for line in out.splitlines() if LONG in line)
        assert row.split()[:4] == [LONG, "heap", "float32", "[2,"] and "…" not in out
    r = CliRunner().invoke(cli, ["--address", long_named.address, "memory"],
                           env={"FORCE_COLOR": "1", "COLUMNS": "80", "DEEPXCTL_WIDE": "1"}, catch_exceptions=False)
    assert LONG in ANSI.sub("", r.stdout)


def test_a_pipe_is_wide_and_wraps_no_less(long_named: Daemon) -> None:
    out = run(long_named, "tensors", "ls", columns=None)
    assert max(len(line) for line in out.splitlines()) <= WIDE
    assert out.splitlines()[0].split() == ["NAME", "KIND", "DTYPE", "SHAPE", "BYTES", "OWNER", "PARAMETER", "CALL",
                                           "SITE", "NODE"]
    assert next(line for line in out.splitlines() if line.startswith("w1 ")).split()[:3] == ["w1", "stack",
                                                                                           "float32"]


def test_tensors_show_wraps_the_name_but_keeps_all_of_it(long_named: Daemon) -> None:
    lines = run(long_named, "tensors", "show", LONG).splitlines()
    assert max(len(line) for line in lines) <= 80, lines
    kind = next(i for i, line in enumerate(lines) if line.startswith("kind"))
    assert "".join(line.removeprefix("name").strip() for line in lines[:kind]) == LONG
