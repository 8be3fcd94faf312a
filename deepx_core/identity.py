"""Who a client is, as the daemon shows it beside the tensors it made (`deepxctl tensors ls`'s OWNER): the program's
name, its pid and its host. Sent in the native protocol's `hello`; an embedded daemon takes it from its own process.
And which /dev/shm a process sees (`shm_identity`): whether two processes can map each other's segments.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

#: how long a client's name may be (a longer one is cut): it is shown in a table column and stored per heap tensor
NAME_MAX = 64


def program_name() -> str:
    """The running program as an operator knows it: the script's file name (`train.py`), the package of
    `python -m pkg` (`pytest`), `python` for `python -c` or an interactive interpreter."""
    argv0 = sys.argv[0] if sys.argv else ""
    if not argv0 or argv0 in ("-c", "-"):
        return "python"
    base = os.path.basename(argv0)
    if base == "__main__.py":  # python -m pkg: the package is the name
        return os.path.basename(os.path.dirname(argv0)) or "python"
    return base


def this_process(name: str | None = None) -> dict[str, Any]:
    """The hello fields that say who this process is: `name` (default: program_name()), `pid`, `host`."""
    return {"name": (name or program_name())[:NAME_MAX], "pid": os.getpid(), "host": socket.gethostname()}


def shm_identity() -> str:
    """Which /dev/shm this process sees: the kernel's boot id and the device of the mount. Two processes that share
    it can map each other's segments (containers, or namespaces, with a /dev/shm of their own cannot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/dev/shm').st_dev}"
    except OSError:
        return ""
