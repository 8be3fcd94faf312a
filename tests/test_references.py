"""References resolve: every `docs/....md`, `bench/....py` or `examples/...` path the tree cites and every relative
link of its Markdown names a file of the repository, and nothing points outside it (issue 27, item 5: skip
messages named a file beside the checkout, docs cited a page the repository did not have)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CITED = re.compile(r"(?<![\w/.-])((?:docs|bench|examples)/[\w./-]*\w\.(?:md|py|ipynb|txt))")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / p for p in out if p.endswith((".py", ".md", ".toml")) and (ROOT / p).is_file()]


def test_cited_paths_exist() -> None:
    missing = []
    for path in tracked():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for ref in CITED.findall(line):
                if not ref.startswith("bench/results/") and not (ROOT / ref).exists():  # results: a run's output
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {ref}")
    assert not missing, "\n".join(missing)


def test_markdown_links_resolve() -> None:
    broken = []
    for path in tracked():
        if path.suffix != ".md":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if "://" in target or target.startswith("mailto:"):
                    continue
                if not (path.parent / target).resolve().exists():
                    broken.append(f"{path.relative_to(ROOT)}:{n}: {target}")
    assert not broken, "\n".join(broken)


def test_nothing_points_outside_the_repository() -> None:
    outside = [f"{p.relative_to(ROOT)}:{n}" for p in tracked() if p != Path(__file__)
               for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if "../shared/" in line]
    assert not outside, outside
