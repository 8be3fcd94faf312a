"""Devices as torch code writes them: `dx.device("cuda:0")`, `x.to("cuda")`, `x.cuda()`, `x.device`,
`dx.cuda.is_available()`, `model.to(device)`.

Placement is the daemon's: every tensor of a session lives on the one op worker its daemon runs (op-cuda where it
runs one, else op-cpu). A device named in code is therefore a hint with nothing to do, never an error: the same
script runs unchanged on a CPU-only daemon and on a GPU one. `x.device` says where the daemon keeps the tensor
(`cuda:0` on an op-cuda daemon, `cpu` otherwise) and `dx.cuda.is_available()` whether the session's daemon computes
on a GPU, so that `device = "cuda" if dx.cuda.is_available() else "cpu"` picks what the daemon does anyway.
"""

from __future__ import annotations

import weakref
from typing import Any

from deepx_core.errors import DeepxError

__all__ = ["cuda", "device", "is_device", "session_device"]

#: device types a script may name; each means "wherever the daemon places tensors"
TYPES = frozenset({"cpu", "cuda", "mps", "xpu", "deepx"})


class device:
    """torch.device's shape: a type and an optional index (`device("cuda:1")`, `device("cuda", 1)`)."""

    __slots__ = ("index", "type")
    type: str
    index: int | None

    def __init__(self, type: Any, index: int | None = None) -> None:
        if isinstance(type, device):
            type, index = str(type), None
        if not isinstance(type, str):
            raise DeepxError(f"device: expected a string like 'cpu' or 'cuda:0', got {type!r}")
        kind, sep, number = type.partition(":")
        if sep:
            if index is not None:
                raise DeepxError(f"device: {type!r} has an index already; give index= or 'type:index', not both")
            if not number.isdigit():
                raise DeepxError(f"device: invalid device string {type!r} (expected 'type' or 'type:index')")
            index = int(number)
        if kind not in TYPES:
            raise DeepxError(f"device: unknown device type {kind!r}; deepx accepts {', '.join(sorted(TYPES))} (the "
                             "daemon places every tensor: a device in code is a hint)")
        if index is not None and (not isinstance(index, int) or index < 0):
            raise DeepxError(f"device: the index must be a non-negative integer, got {index!r}")
        self.type, self.index = kind, index

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        index = "" if self.index is None else f", index={self.index}"
        return f"device(type={self.type!r}{index})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = device(other)
            except DeepxError:
                return False
        return isinstance(other, device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self) -> int:
        return hash((self.type, self.index))


def is_device(x: Any) -> bool:
    """Whether `x` names a device (a device, or a string such as 'cuda:0'), as `.to()` tells a device from a dtype."""
    if isinstance(x, device):
        return True
    return isinstance(x, str) and x.partition(":")[0] in TYPES


def _roles(transport: Any) -> list[str]:
    client = getattr(transport, "client", None)  # a running deepxd: what its hello answered
    if client is not None:
        return list(getattr(client, "server", {}).get("roles") or [])
    embedded = getattr(transport, "embedded", None)
    if embedded is not None:
        return list(embedded.config.roles)
    return []  # deepxIR over UDP: the daemon does not say


_PLACED: weakref.WeakKeyDictionary[Any, device] = weakref.WeakKeyDictionary()  # session -> its daemon's device


def session_device(s: Any) -> device:
    """Where the daemon of session `s` keeps its tensors."""
    found = _PLACED.get(s)
    if found is None:
        placed = getattr(s.transport, "placed", "")  # a GPU the daemon placed it on (dx.connect(device=...))
        found = _PLACED[s] = (device(placed) if placed else device("cuda", 0) if "op-cuda" in _roles(s.transport)
                              else device("cpu"))
    return found


def placed_again(s: Any) -> None:
    """Session `s` was placed on another GPU (init_process_group): its device is asked again."""
    _PLACED.pop(s, None)


class _Cuda:
    """`dx.cuda`: torch.cuda's questions, answered for the session's daemon."""

    @staticmethod
    def is_available() -> bool:
        from deepx_sdk.session import session

        return session_device(session()).type == "cuda"

    @staticmethod
    def device_count() -> int:
        return 1 if _Cuda.is_available() else 0

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Wait until every recorded instruction has run (as torch.cuda.synchronize waits for the GPU)."""
        from deepx_sdk.session import session

        session().sync()

    @staticmethod
    def manual_seed(seed: int) -> None:
        from deepx_sdk import manual_seed

        manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def empty_cache() -> None:
        from deepx_sdk import empty_cache

        empty_cache()


cuda = _Cuda()
