"""Named POSIX shared-memory segments that any process can attach to by name, and see the same bytes.

Unlike `multiprocessing.shared_memory`, nothing here registers with the resource tracker (on 3.11 it unlinks
segments that other processes attached to, and warns at exit): a segment lives until someone calls `unlink()`.
Segments are opened with `_posixshmem` (what multiprocessing uses) where it exists, else as files in /dev/shm, mode
0600, and mapped with libc's mmap (MAP_SHARED) through ctypes: the descriptor is closed once the memory is mapped
(Python's mmap.mmap keeps a dup of it for the mapping's life, one descriptor per tensor). A segment's memory is
reserved when it is made (posix_fallocate), so writing it can never fault for want of shared memory.
Linux is the target; elsewhere only `list_segments` finds nothing.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import mmap
import os
import re
import stat
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy

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


class OutOfSharedMemory(DeepxError):
    """Shared memory (/dev/shm) has not the bytes a segment asked for: `asked`, `free` (None: unknown)."""

    def __init__(self, message: str, asked: int, free: int | None) -> None:
        super().__init__(message)
        self.asked = asked
        self.free = free


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """One region mapped by libc's mmap, which keeps no descriptor. Arrays over it hold it as their base (numpy's
    `__array_interface__`), so it is unmapped only when the segment is closed and no array views it any more."""

    __slots__ = ("__weakref__", "addr", "size")

    def __init__(self, fd: int, size: int, name: str) -> None:
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map shared-memory segment {name!r} ({size} bytes): {os.strerror(err)}")
        self.addr: int = addr
        self.size = size

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {"data": (self.addr, False), "shape": (self.size,), "typestr": "|u1", "version": 3}

    def __del__(self, munmap: Any = _libc.munmap) -> None:
        addr, self.addr = self.addr, 0
        if addr:
            munmap(addr, self.size)


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


def _node_in_name(node: str) -> str:
    """The node as a segment name holds it: characters a segment name cannot hold become '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", node) or "_"


def segment_name(node: str) -> str:
    """A fresh name `deepx-<node>-<pid>-<counter>`."""
    return f"deepx-{_node_in_name(node)}-{os.getpid()}-{next(_counter)}"


def parse_segment_name(name: str) -> tuple[str, int] | None:
    """(node, pid) of a name that `segment_name` made (the node as the name holds it), else None."""
    m = re.fullmatch(r"deepx-(.+)-(\d+)-\d+", name)
    return (m.group(1), int(m.group(2))) if m else None


def segment_pid(name: str, node: str) -> int | None:
    """The pid in a name that `segment_name(node)` made, or None if the name is not of that form."""
    parsed = parse_segment_name(name)
    return parsed[1] if parsed is not None and parsed[0] == _node_in_name(node) else None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts)."""
    if pid <= 0:
        return True  # never a process of ours: treated as alive, so nothing of it is removed
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shm_total_bytes() -> int | None:
    """/dev/shm's size in bytes (a container's --shm-size; half the RAM by default on a host); None where unknown."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize or None


def shm_free_bytes() -> int | None:
    """Bytes free in /dev/shm for an unprivileged user; None where unknown (no /dev/shm, or a tmpfs without limit)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    if st.f_blocks == 0:
        return None
    return st.f_bavail * st.f_frsize


def _reserve(fd: int, name: str, nbytes: int, have: int = 0) -> None:
    """Allocate the first `nbytes` of the segment (tmpfs reserves its pages, or refuses with ENOSPC), so that
    writing them never faults (SIGBUS); `have`: bytes already reserved. OutOfSharedMemory when they do not fit."""
    if nbytes <= have or not hasattr(os, "posix_fallocate"):
        return
    free = shm_free_bytes()
    if free is not None and nbytes - have > free:  # refused before touching a page
        raise OutOfSharedMemory(f"shared-memory segment {name!r}: {nbytes} bytes asked, {free} bytes free in "
                                f"{SHM_DIR}", nbytes, free)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            free = shm_free_bytes()
            raise OutOfSharedMemory(f"shared-memory segment {name!r}: {nbytes} bytes asked, "
                                    f"{'an unknown number of' if free is None else free} bytes free in {SHM_DIR} "
                                    f"({e.strerror})", nbytes, free) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        log.debug("shared-memory segment %r: cannot reserve its memory here (%s)", name, e.strerror)


class Segment:
    """One named shared-memory segment, mapped into this process (no descriptor kept open). `reserved`: how many of
    its first bytes are allocated (writing past them on a full /dev/shm would fault)."""

    def __init__(self, name: str, size: int, mapping: _Mapping, reserved: int = 0) -> None:
        self.name = name
        self.size = size
        self.reserved = reserved
        self._bytes: np.ndarray | None = np.asarray(mapping)  # its base is the mapping: the views keep it alive

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, size={self.size}{'' if self._bytes is not None else ', closed'})"

    @classmethod
    def create(cls, name: str, size: int, reserve: int | None = None) -> Segment:
        """A new segment of `size` bytes (at least 1: a zero-size tensor still gets a valid segment), zero-filled,
        whose first `reserve` bytes (all by default) are allocated now. SegmentExists if the name is taken;
        OutOfSharedMemory (naming the bytes asked and free) if /dev/shm cannot hold them."""
        _check_name(name)
        if size < 0:
            raise DeepxError(f"shared-memory segment {name!r}: size {size} is negative")
        size = max(size, 1)
        reserve = size if reserve is None else min(max(reserve, 1), size)
        try:
            fd = _open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        except FileExistsError:
            raise SegmentExists(
                f"shared-memory segment {name!r} already exists; attach to it or pick another name") from None
        except OSError as e:
            raise DeepxError(f"cannot create shared-memory segment {name!r} ({size} bytes): {e.strerror}") from e
        try:
            os.ftruncate(fd, size)
            _reserve(fd, name, reserve)
            mapping = _Mapping(fd, size, name)
        except BaseException as e:
            _unlink(name)
            if isinstance(e, OSError):
                raise DeepxError(f"cannot size shared-memory segment {name!r} to {size} bytes: {e.strerror}") from e
            raise
        finally:
            os.close(fd)
        return cls(name, size, mapping, reserve)

    @classmethod
    def attach(cls, name: str, reserve: int = 0) -> Segment:
        """Map an existing segment (made by this or another process); DeepxError if there is none by that name.
        reserve: allocate its first `reserve` bytes now (a segment an older daemon made sparse), OutOfSharedMemory if
        /dev/shm cannot hold them."""
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
            reserve = min(reserve, st.st_size)
            if reserve > 0:
                _reserve(fd, name, reserve, min(st.st_blocks * 512, reserve))
            mapping = _Mapping(fd, st.st_size, name)
        except OSError as e:
            raise DeepxError(f"cannot map shared-memory segment {name!r}: {e.strerror}") from e
        finally:
            os.close(fd)
        return cls(name, st.st_size, mapping, max(reserve, 0))

    def reserve(self, nbytes: int) -> None:
        """Allocate the first `nbytes` now (a pooled segment given to a larger tensor); OutOfSharedMemory when
        /dev/shm cannot hold them."""
        nbytes = min(nbytes, self.size)
        if nbytes <= self.reserved:
            return
        try:
            fd = _open(self.name, os.O_RDWR)
        except OSError as e:
            raise DeepxError(f"cannot open shared-memory segment {self.name!r} to reserve {nbytes} bytes: "
                             f"{e.strerror}") from e
        try:
            _reserve(fd, self.name, nbytes, self.reserved)
        finally:
            os.close(fd)
        self.reserved = nbytes

    @property
    def closed(self) -> bool:
        return self._bytes is None

    def array(self, shape: Sequence[int], dtype: str | np.dtype[Any], offset: int = 0) -> np.ndarray:
        """A zero-copy view of the segment's bytes from `offset` as an array (dtype: a deepx precision name)."""
        if self._bytes is None:
            raise DeepxError(f"shared-memory segment {self.name!r} is closed")
        dt = to_numpy(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if offset < 0 or offset + nbytes > self.size:
            raise DeepxError(f"shared-memory segment {self.name!r} holds {self.size} bytes; an array of shape "
                             f"{list(shape)} {dtype} at offset {offset} needs {offset + nbytes}")
        # a view of the mapping's array: it keeps the mapping (its base) alive, so none can dangle after close()
        return self._bytes[offset:offset + nbytes].view(dt).reshape(shape)

    def zero(self, nbytes: int | None = None) -> None:
        """Zero the first `nbytes` bytes (all by default)."""
        n = self.size if nbytes is None else min(nbytes, self.size)
        if n > 0:
            self.array((n,), np.dtype(np.uint8)).fill(0)

    def close(self) -> None:
        """Unmap from this process (the segment itself stays until unlink). Arrays still viewing it keep the
        mapping alive until they are collected."""
        self._bytes = None

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


@dataclass(frozen=True)
class Orphan:
    """A segment left by a process that died: `size` its length, `held` the bytes of memory it holds."""

    name: str
    node: str
    pid: int
    size: int
    held: int


def orphan_segments(referenced: Collection[str]) -> list[Orphan]:
    """The segments in /dev/shm named by `segment_name` whose process is dead and that no name in `referenced` (the
    handles of heap tensor records) refers to. A segment of a live pid is never one."""
    found = []
    for name in list_segments("deepx-"):
        parsed = parse_segment_name(name)
        if parsed is None or name in referenced or pid_alive(parsed[1]):
            continue
        try:
            st = os.stat(os.path.join(SHM_DIR, name))
        except OSError:
            continue  # gone meanwhile
        found.append(Orphan(name, parsed[0], parsed[1], st.st_size, st.st_blocks * 512))
    return found
