"""Named POSIX shared-memory segments that any process can attach to by name, and see the same bytes.

Unlike `multiprocessing.shared_memory`, nothing here registers with the resource tracker (on 3.11 it unlinks
segments that other processes attached to, and warns at exit): a segment lives until someone calls `unlink()`.
Segments are opened with `_posixshmem` (what multiprocessing uses) where it exists, else as files in /dev/shm, and
mapped with mmap (MAP_SHARED), mode 0600. Linux is the target; elsewhere only `list_segments` finds nothing.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np

from deepx_sdk.errors import DeepxError
from deepx_sdk.ir.dtypes import to_numpy

try:
    import _posixshmem
except ImportError:  # pragma: no cover - every CPython on Linux and macOS has it
    _posixshmem = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MODE = 0o600
_NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")
_counter = itertools.count()


class SegmentExists(DeepxError):
    """Segment.create was given the name of a segment that already exists."""


def _check_name(name: str) -> None:
    if not _NAME_OK.match(name) or name in (".", ".."):
        raise DeepxError(f"shared-memory segment name {name!r} is not valid: use letters, digits, '.', '_' and '-'")


def _open(name: str, flags: int) -> int:
    if _posixshmem is not None:
        return _posixshmem.shm_open("/" + name, flags, MODE)
    return os.open(os.path.join(SHM_DIR, name), flags, MODE)


def _unlink(name: str) -> None:
    if _posixshmem is not None:
        _posixshmem.shm_unlink("/" + name)
    else:
        os.unlink(os.path.join(SHM_DIR, name))


def segment_name(node: str) -> str:
    """A fresh name `deepx-<node>-<pid>-<counter>` (characters a segment name cannot hold become '_')."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node) or "_"
    return f"deepx-{safe}-{os.getpid()}-{next(_counter)}"


def segment_pid(name: str, node: str) -> int | None:
    """The pid in a name that `segment_name(node)` made, or None if the name is not of that form."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node) or "_"
    m = re.fullmatch(rf"deepx-{re.escape(safe)}-(\d+)-\d+", name)
    return int(m.group(1)) if m else None


class Segment:
    """One named shared-memory segment, mapped into this process."""

    def __init__(self, name: str, size: int, mm: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self._mmap: mmap.mmap | None = mm

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, size={self.size}{'' if self._mmap is not None else ', closed'})"

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """A new segment of `size` bytes (at least 1: a zero-size tensor still gets a valid segment), zero-filled.
        SegmentExists if the name is taken."""
        _check_name(name)
        if size < 0:
            raise DeepxError(f"shared-memory segment {name!r}: size {size} is negative")
        size = max(size, 1)
        try:
            fd = _open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        except FileExistsError:
            raise SegmentExists(
                f"shared-memory segment {name!r} already exists; attach to it or pick another name") from None
        except OSError as e:
            raise DeepxError(f"cannot create shared-memory segment {name!r} ({size} bytes): {e.strerror}") from e
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            _unlink(name)
            raise DeepxError(f"cannot size shared-memory segment {name!r} to {size} bytes: {e.strerror}") from e
        os.close(fd)  # mmap keeps its own descriptor
        return cls(name, size, mm)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment (made by this or another process); DeepxError if there is none by that name."""
        _check_name(name)
        try:
            fd = _open(name, os.O_RDWR)
        except FileNotFoundError:
            raise DeepxError(
                f"no shared-memory segment named {name!r}: its tensor was freed or its daemon stopped") from None
        except OSError as e:
            raise DeepxError(f"cannot open shared-memory segment {name!r}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                raise DeepxError(f"shared-memory segment {name!r} is empty or not a segment; it cannot be mapped")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(name, st.st_size, mm)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def array(self, shape: Sequence[int], dtype: str | np.dtype[Any], offset: int = 0) -> np.ndarray:
        """A zero-copy view of the segment's bytes from `offset` as an array (dtype: a deepx precision name)."""
        if self._mmap is None:
            raise DeepxError(f"shared-memory segment {self.name!r} is closed")
        dt = to_numpy(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if offset < 0 or offset + nbytes > self.size:
            raise DeepxError(f"shared-memory segment {self.name!r} holds {self.size} bytes; an array of shape "
                             f"{list(shape)} {dtype} at offset {offset} needs {offset + nbytes}")
        # frombuffer holds a buffer export, so close() cannot unmap memory under a live view
        # (np.ndarray(buffer=mmap) holds none: closing then would leave the view dangling)
        n = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._mmap, dtype=dt, count=n, offset=offset).reshape(shape)

    def zero(self, nbytes: int | None = None) -> None:
        """Zero the first `nbytes` bytes (all by default)."""
        n = self.size if nbytes is None else min(nbytes, self.size)
        if n > 0:
            self.array((n,), np.dtype(np.uint8)).fill(0)

    def close(self) -> None:
        """Unmap from this process (the segment itself stays until unlink). Arrays still viewing it keep the
        mapping alive until they are collected."""
        mm, self._mmap = self._mmap, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views are still exported: the mapping goes when the last one is collected

    def unlink(self) -> None:
        """Remove the name; processes that mapped it keep their mapping. Unlinking twice is harmless."""
        unlink_segment(self.name)


def unlink_segment(name: str) -> bool:
    """Remove a segment by name; False if there was none."""
    _check_name(name)
    try:
        _unlink(name)
    except FileNotFoundError:
        return False
    return True


def segment_exists(name: str) -> bool:
    try:
        _check_name(name)
        fd = _open(name, os.O_RDONLY)
    except (FileNotFoundError, DeepxError):
        return False
    os.close(fd)
    return True


def list_segments(prefix: str = "deepx-") -> list[str]:
    """Names of the segments in /dev/shm that start with `prefix`, sorted ([] where there is no /dev/shm)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(prefix))
