"""Loading the CUDA toolkit's shared libraries (cuBLAS, NVRTC) through ctypes, by the names they go by."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable, Sequence

from deepx_core.errors import DeepxError

log = logging.getLogger(__name__)


def load(env: str, names: Sequence[str], short: str, declare: Callable[[ctypes.CDLL], None], what: str
         ) -> ctypes.CDLL:
    """The first of `$env`, `names`, then whatever the loader finds for `short`, that loads; `declare` sets its
    functions' types. DeepxError naming every place tried where none loads."""
    errors = []
    # the loader's own search runs ldconfig: only where the usual names did not load
    for name in [os.environ.get(env, ""), *names, None]:
        if name is None:
            name = ctypes.util.find_library(short) or ""
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
            continue
        declare(lib)
        log.info("cuda: %s from %s", what, name)
        return lib
    raise DeepxError(f"lib{short}.so not found (" + "; ".join(errors) + f"); set {env} to its path")
