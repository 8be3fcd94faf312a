"""The examples' progress bar: rich's, live in a terminal and in a notebook with ipywidgets. In a notebook without
ipywidgets (rich's live display there needs it, and warns "install ipywidgets"), the bar is drawn once, finished,
instead of live; written to a pipe or a file, likewise."""

from __future__ import annotations

import importlib.util

from rich.console import Console
from rich.progress import Progress


def progress_bar() -> Progress:
    console = Console()
    if console.is_jupyter and importlib.util.find_spec("ipywidgets") is None:
        console = Console(force_jupyter=False)
    return Progress(console=console)
