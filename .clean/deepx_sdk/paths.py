"""Where a deepxd listens by default, shared by the daemon, the SDK and deepxctl."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/deepx, else <tmp>/deepx-<uid>: a private directory (mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "deepx"
    return Path(tempfile.gettempdir()) / f"deepx-{os.getuid()}"


def default_socket() -> str:
    return str(runtime_dir() / "deepxd.sock")


def default_address() -> str:
    """DEEPX_ADDRESS, else the default socket as a unix:// URL."""
    return os.environ.get("DEEPX_ADDRESS") or f"unix://{default_socket()}"
