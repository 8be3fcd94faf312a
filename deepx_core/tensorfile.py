"""The deepx tensor file format (docs/deepxir.md section 5): `P.shape` (YAML) beside `P.data` (raw little-endian bytes).

Every file is opened relative to a descriptor of its directory and never through a link: the `*_at` functions take
that descriptor (the daemon opens it once, checked against its io roots: `open_directory`), the plain-path ones open
the path's directory themselves. A link, or anything but a regular file, where a tensor file goes is refused.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import from_numpy, to_numpy
from deepx_core.ir.shapes import numel

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_PATH (Linux): a directory descriptor for the *at calls that needs no read permission on the directory
_DIR = getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
_READ = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC  # NONBLOCK: a FIFO must not hang a read
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC  # EXCL: never opens what is already there
MAX_SHAPE_BYTES = 1 << 20  # a shape file is a few lines

_T = TypeVar("_T")


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def shape_doc(shape: tuple[int, ...], dtype: str) -> dict:
    return {"dtype": dtype, "dim": len(shape), "shape": list(shape), "stride": _contiguous_strides(shape),
            "size": numel(shape)}


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def _not_regular(shown: str, mode: int) -> DeepxError:
    what = _kind(mode)
    if what == "a symbolic link":
        return DeepxError(f"{shown} is a symbolic link; tensor files are never opened through links (put the file "
                          "itself there, or remove the link)")
    return DeepxError(f"{shown} is {what}, not a regular file (remove it, or pick another path)")


def open_directory(path: str | os.PathLike[str], *, create: bool = False) -> int:
    """A descriptor of the directory at absolute, link-free (resolved) `path`, opened one component at a time from `/`
    with O_NOFOLLOW, so that a component made a link after the path was checked is refused instead of followed (no
    /proc needed); missing components are made where `create`. DeepxError names what is wrong."""
    path = os.fspath(path)
    if not os.path.isabs(path):
        raise DeepxError(f"open_directory: {path} is not an absolute path")
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        raise DeepxError(f"{path}: '..' in a resolved directory path")
    fd = os.open("/", _DIR)
    try:
        here = ""
        for part in parts:
            here += "/" + part
            try:
                nxt = os.open(part, _DIR | _NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise DeepxError(f"directory {here} not found") from None
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile; opened below as any other
                except OSError as e:
                    raise DeepxError(f"cannot make directory {here}: {e.strerror}") from None
                try:
                    nxt = os.open(part, _DIR | _NOFOLLOW, dir_fd=fd)
                except OSError as e:  # replaced by a link or a file since it was made
                    raise DeepxError(f"cannot open directory {here}: {e.strerror}; refusing to follow it") from None
            except OSError as e:
                try:
                    st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    raise DeepxError(f"cannot open directory {here}: {e.strerror}") from None
                raise DeepxError(f"{here} is {_kind(st.st_mode)}, where a directory was checked (it changed, or is "
                                 "not a directory); refusing to follow it") from None
            mode = os.fstat(nxt).st_mode
            if not stat.S_ISDIR(mode):  # O_PATH|O_NOFOLLOW opens a link itself
                os.close(nxt)
                raise DeepxError(f"{here} is {_kind(mode)}, where a directory was checked; refusing to follow it")
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_read(dir_fd: int, name: str, shown: str) -> tuple[int, os.stat_result]:
    """A regular file `name` in `dir_fd`, opened for reading without following a link; FileNotFoundError passes."""
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            raise DeepxError(f"cannot read {shown}: {e.strerror}") from None
        if e.errno in (errno.ELOOP, errno.EMLINK) or not stat.S_ISREG(st.st_mode):
            raise _not_regular(shown, st.st_mode) from None
        raise DeepxError(f"cannot read {shown}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _not_regular(shown, st.st_mode)
    if st.st_nlink > 1:  # a hard link is a regular file too: it may be one outside the io root linked in
        os.close(fd)
        raise DeepxError(f"{shown} has {st.st_nlink} hard links, and may be a file from elsewhere linked in; a tensor "
                         "file is read only where it has one name (copy it instead of linking it)")
    return fd, st


def _create(dir_fd: int, name: str, shown: str) -> int:
    """A new regular file `name` in `dir_fd`, for writing: never an existing one, nor through a link. A regular file
    left there (by a save that died) is removed first; anything else there is refused."""
    for attempt in range(2):
        try:
            return os.open(name, _CREATE, 0o666, dir_fd=dir_fd)
        except FileExistsError:
            pass
        except OSError as e:
            raise DeepxError(f"cannot create {shown}: {e.strerror or e}") from None
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(shown, st.st_mode)
            if not attempt:
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise DeepxError(f"cannot remove {shown}, left by an earlier save: {e.strerror or e}") from None
    raise DeepxError(f"{shown} keeps reappearing: another save of this path is running")


def _write_replace(dir_fd: int, name: str, payload: memoryview | bytes, where: str) -> None:
    """`payload` as file `name` in `dir_fd`, replaced atomically: written to `name.tmp`, then renamed over `name`
    (rename replaces a link there, never its target)."""
    tmp = name + ".tmp"
    fd = _create(dir_fd, tmp, os.path.join(where, tmp))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as e:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise DeepxError(f"cannot write {os.path.join(where, name)}: {e.strerror or e}") from None
        raise


def write_tensor_at(dir_fd: int, stem: str, array: np.ndarray, where: str = ".") -> None:
    """Write `array` as `stem.data` and `stem.shape` in directory `dir_fd` (whose path `where` is shown in errors),
    each replaced atomically, no link followed."""
    dtype = from_numpy(array.dtype)
    data = np.ascontiguousarray(array)
    if sys.byteorder != "little" and data.dtype.itemsize > 1:
        data = data.byteswap()
    raw = data.reshape(-1).view(np.uint8).data if data.size else b""
    _write_replace(dir_fd, stem + ".data", raw, where)
    import yaml  # here: most processes never write a tensor file, and yaml takes a tenth of a second to import

    doc = yaml.safe_dump(shape_doc(tuple(array.shape), dtype), default_flow_style=None, sort_keys=False)
    _write_replace(dir_fd, stem + ".shape", doc.encode(), where)


def read_shape_at(dir_fd: int, stem: str, where: str = ".") -> tuple[tuple[int, ...], str]:
    """Shape and dtype from `stem.shape` in directory `dir_fd`, checked: stride and size must agree with the shape."""
    import yaml

    path = os.path.join(where, f"{stem}.shape")
    try:
        fd, st = _open_read(dir_fd, f"{stem}.shape", path)
    except FileNotFoundError:
        raise DeepxError(f"tensor file {path} not found") from None
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_SHAPE_BYTES:
            raise DeepxError(f"{path} holds {st.st_size} bytes; a shape file holds at most {MAX_SHAPE_BYTES}")
        try:
            doc = yaml.safe_load(f.read(MAX_SHAPE_BYTES + 1))
        except (OSError, yaml.YAMLError) as e:
            raise DeepxError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict) or "dtype" not in doc or "shape" not in doc:
        raise DeepxError(f"{path}: expected a mapping with at least dtype and shape")
    try:
        shape = tuple(int(d) for d in doc["shape"])
    except (TypeError, ValueError):
        raise DeepxError(f"{path}: shape {doc['shape']!r} is not a list of integers") from None
    if any(d < 0 for d in shape):
        raise DeepxError(f"{path}: shape {list(shape)} has a negative dimension")
    dtype = str(doc["dtype"])
    to_numpy(dtype)
    if "dim" in doc and doc["dim"] != len(shape):
        raise DeepxError(f"{path}: dim {doc['dim']} disagrees with shape {list(shape)}")
    if "stride" in doc and list(doc["stride"] or []) != _contiguous_strides(shape):
        raise DeepxError(
            f"{path}: stride {doc['stride']} disagrees with the row-major stride {_contiguous_strides(shape)} "
            f"of shape {list(shape)}"
        )
    if "size" in doc and doc["size"] != numel(shape):
        raise DeepxError(f"{path}: size {doc['size']} disagrees with shape {list(shape)} ({numel(shape)} elements)")
    return shape, dtype


def read_data_at(dir_fd: int, name: str, shape: tuple[int, ...], dtype: str, where: str = ".") -> np.ndarray:
    """Exactly numel(shape) elements of `dtype` from the raw file `name` in directory `dir_fd`."""
    path = os.path.join(where, name)
    npdt = to_numpy(dtype).newbyteorder("<")
    want = numel(shape) * npdt.itemsize
    try:
        fd, st = _open_read(dir_fd, name, path)
    except FileNotFoundError:
        raise DeepxError(f"tensor data file {path} not found") from None
    with os.fdopen(fd, "rb") as f:
        if st.st_size != want:
            raise DeepxError(f"{path} holds {st.st_size} bytes, but {dtype}{list(shape)} needs exactly {want}")
        array = np.empty(numel(shape), dtype=npdt)
        view = array.view(np.uint8).data
        got = 0
        try:
            while got < want:
                n = f.readinto(view[got:])
                if not n:
                    raise DeepxError(f"{path} ended after {got} bytes; {dtype}{list(shape)} needs {want}")
                got += n
        except OSError as e:
            raise DeepxError(f"cannot read {path}: {e.strerror or e}") from None
    return array.astype(to_numpy(dtype), copy=False).reshape(shape)


def read_tensor_at(dir_fd: int, stem: str, where: str = ".") -> np.ndarray:
    shape, dtype = read_shape_at(dir_fd, stem, where)
    return read_data_at(dir_fd, f"{stem}.data", shape, dtype, where)


def _split(path: str | os.PathLike[str]) -> tuple[str, str]:
    """A path's directory and last component, refused when it names no file."""
    path = os.fspath(path)
    where, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise DeepxError(f"{path} names a directory; a tensor file needs a file name")
    return where or ".", name


def _open_parent(where: str) -> int:
    try:
        return os.open(where, _DIR)
    except FileNotFoundError:
        raise DeepxError(f"directory {where} not found") from None
    except OSError as e:
        raise DeepxError(f"cannot open directory {where}: {e.strerror}") from None


def write_tensor(base: str | os.PathLike[str], array: np.ndarray) -> None:
    """Write `array` as `base.shape` and `base.data` (see write_tensor_at); the directory is made if missing."""
    where, stem = _split(base)
    Path(where).mkdir(parents=True, exist_ok=True)
    fd = _open_parent(where)
    try:
        write_tensor_at(fd, stem, array, where)
    finally:
        os.close(fd)


def _at_parent(path: str | os.PathLike[str], missing: str, read: Callable[[int, str, str], _T]) -> _T:
    """read(directory fd, file name, directory) on the file at `path`, its directory opened without links;
    `missing`: the error where that directory is not there."""
    where, name = _split(path)
    try:
        fd = _open_parent(where)
    except DeepxError:
        raise DeepxError(missing) from None
    try:
        return read(fd, name, where)
    finally:
        os.close(fd)


def read_shape(base: str | os.PathLike[str]) -> tuple[tuple[int, ...], str]:
    """Shape and dtype from `base.shape` (see read_shape_at)."""
    return _at_parent(base, f"tensor file {base}.shape not found", read_shape_at)


def read_data(path: str | os.PathLike[str], shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Exactly numel(shape) elements of `dtype` from the raw file at `path` (see read_data_at)."""
    return _at_parent(path, f"tensor data file {path} not found",
                      lambda fd, name, where: read_data_at(fd, name, shape, dtype, where))


def read_tensor(base: str | os.PathLike[str]) -> np.ndarray:
    return _at_parent(base, f"tensor file {base}.shape not found", read_tensor_at)
