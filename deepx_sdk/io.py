"""Saving and loading tensors: the deepx tensor file format and safetensors.

    import deepx_sdk as dx
    dx.io.save(x, "ckpt/x")                   # ckpt/x.shape + ckpt/x.data (docs/deepxir.md section 5)
    x = dx.io.load("ckpt/x")
    dx.io.save(state_dict, "model.safetensors")   # a dict of name -> tensor: one safetensors file
    state_dict = dx.io.load("model.safetensors")  # name -> dx Tensor, in the file's order

A single tensor goes to the deepx tensor file format (readable by every deepx program); a dict of tensors (a state
dict) goes to safetensors, the format PyTorch's ecosystem uses, so weights move between deepx and PyTorch both ways.
`save_safetensors`/`load_safetensors` are the numpy-level functions beneath, implemented here (no dependency on the
`safetensors` package): an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets},
"__metadata__": {str: str}} padded with spaces to 8 bytes, then the raw little-endian bytes, with no holes.
"""

from __future__ import annotations

import functools
import json
import mmap as _mmap
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import STORABLE, from_numpy
from deepx_core.ir.shapes import numel
from deepx_core.tensorfile import read_tensor, write_tensor
from deepx_sdk.tensor import Tensor, tensor

__all__ = ["load", "load_safetensors", "safetensors_metadata", "save", "save_safetensors"]

PathLike = str | os.PathLike[str]

def _storable(dt: np.dtype) -> bool:
    try:
        return from_numpy(dt) in STORABLE
    except DeepxError:
        return False


@functools.cache
def _safetensors_dtypes() -> tuple[dict[str, np.dtype], dict[np.dtype, str], frozenset[str]]:
    """safetensors dtype name -> numpy dtype (the numpy level reads and writes all of these; dx tensors need
    STORABLE), its inverse, and the names dx tensors can hold. Built on first use: ml_dtypes is slow to import."""
    import ml_dtypes

    table: dict[str, np.dtype] = {
        "F64": np.dtype(np.float64),
        "F32": np.dtype(np.float32),
        "F16": np.dtype(np.float16),
        "BF16": np.dtype(ml_dtypes.bfloat16),
        "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
        "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
        "I64": np.dtype(np.int64),
        "I32": np.dtype(np.int32),
        "I16": np.dtype(np.int16),
        "I8": np.dtype(np.int8),
        "U64": np.dtype(np.uint64),
        "U32": np.dtype(np.uint32),
        "U16": np.dtype(np.uint16),
        "U8": np.dtype(np.uint8),
        "BOOL": np.dtype(np.bool_),
        "C64": np.dtype(np.complex64),
    }
    if hasattr(ml_dtypes, "float8_e8m0fnu"):
        table["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)
    names = {dt: name for name, dt in table.items()}
    return table, names, frozenset(name for name, dt in table.items() if _storable(dt))


def __getattr__(name: str) -> Any:
    """SAFETENSORS_DTYPES and DEEPX_SAFETENSORS_DTYPES (the safetensors dtypes dx tensors can hold), on first use."""
    if name == "SAFETENSORS_DTYPES":
        return _safetensors_dtypes()[0]
    if name == "DEEPX_SAFETENSORS_DTYPES":
        return _safetensors_dtypes()[2]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MAX_HEADER = 100_000_000  # the limit of the reference implementation
_METADATA = "__metadata__"
_SINGLE = "tensor"  # the entry name of a lone tensor saved to a .safetensors path


# ---------------------------------------------------------------- the dx level


def save(obj: Any, path: PathLike) -> None:
    """Save a tensor or a state dict.

    A `Tensor` (or numpy array) goes to the deepx tensor file format at base path `path`: `path.shape` (YAML) and
    `path.data` (raw bytes), unless `path` ends with `.safetensors`, which gives a one-entry safetensors file (entry
    "tensor"). A dict of name -> Tensor/array (a state dict) goes to one safetensors file at `path`, in the dict's
    order. Values are read from the daemon in one round trip per session. Only deepx's dtypes are accepted.
    """
    p = os.fspath(path)
    if isinstance(obj, Mapping):
        save_safetensors(_to_numpy(obj), p)
    elif isinstance(obj, (Tensor, np.ndarray, np.generic)):
        array = _to_numpy({_SINGLE: obj})[_SINGLE]
        if p.endswith(".safetensors"):
            save_safetensors({_SINGLE: array}, p)
        else:
            write_tensor(_base(p), array)
    else:
        hint = "; save model.state_dict()" if hasattr(obj, "state_dict") else ""
        raise DeepxError(
            f"dx.save: cannot save a {type(obj).__name__}; it saves a Tensor, a numpy array, or a dict of name -> "
            f"tensor (a state dict){hint}"
        )


def load(path: PathLike) -> Tensor | dict[str, Tensor]:
    """Load what `save` wrote: a Tensor from a deepx tensor file (base path `path`, `path.shape` exists), or a dict
    name -> Tensor, in the file's order, from a safetensors file (`path` ends with `.safetensors`, or is a plain
    file with no `path.shape` beside it)."""
    p = os.fspath(path)
    if not p.endswith(".safetensors"):
        base = _base(p)
        if os.path.exists(base + ".shape"):
            return tensor(read_tensor(base))
        if not os.path.exists(p):
            raise DeepxError(
                f"dx.load: no tensor file at {p}: neither {base}.shape (a deepx tensor file) nor {p} (safetensors) "
                "exists"
            )
    arrays = load_safetensors(p)
    _, st_names, storable = _safetensors_dtypes()
    for name, array in arrays.items():
        if st_names.get(array.dtype) not in storable:
            raise DeepxError(
                f"{p}: tensor '{name}' has dtype {st_names.get(array.dtype, array.dtype)}, which deepx cannot store "
                f"(deepx stores {', '.join(sorted(STORABLE))}); deepx_sdk.io.load_safetensors reads it as numpy"
            )
    return {name: tensor(array) for name, array in arrays.items()}


def _base(p: str) -> str:
    """The base path of a deepx tensor file: `P`, `P.shape` and `P.data` all name the tensor at `P`."""
    for suffix in (".shape", ".data"):
        if p.endswith(suffix) and len(p) > len(suffix):
            return p[: -len(suffix)]
    return p


def _to_numpy(objs: Mapping[Any, Any]) -> dict[str, np.ndarray]:
    """Numpy arrays of tensors and arrays, checked to have a deepx dtype; dx tensors are fetched in one sync per
    session."""
    out: dict[str, np.ndarray] = {}
    fetch: dict[Any, list[str]] = {}  # session -> tensor names to read
    for key, value in objs.items():
        if not isinstance(key, str):
            raise DeepxError(f"dx.save: state dict keys must be strings, not {type(key).__name__} ({key!r})")
        if isinstance(value, Tensor):
            names = fetch.setdefault(value._s, [])
            if value.name not in names:
                names.append(value.name)
        elif isinstance(value, (np.ndarray, np.generic)):
            out[key] = np.asarray(value)
        elif isinstance(value, Mapping):
            raise DeepxError(
                f"dx.save: '{key}' holds a dict; dx.save writes a flat dict of name -> tensor (a state dict)"
            )
        else:
            raise DeepxError(f"dx.save: '{key}' is a {type(value).__name__}, not a Tensor or numpy array")
    values: dict[tuple[int, str], np.ndarray] = {}
    for sess, names in fetch.items():
        for name, array in sess.sync(fetch=tuple(names)).items():
            values[(id(sess), name)] = array
    result: dict[str, np.ndarray] = {}
    for key, value in objs.items():
        array = values[(id(value._s), value.name)].reshape(value.shape) if isinstance(value, Tensor) else out[key]
        try:
            from_numpy(array.dtype)
        except DeepxError as e:
            raise DeepxError(f"dx.save: cannot save '{key}': {e}") from None
        result[key] = array
    return result


# ---------------------------------------------------------------- safetensors, numpy level


def save_safetensors(tensors: Mapping[str, np.ndarray], path: PathLike,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write numpy arrays as one safetensors file at `path` (replaced atomically).

    The header lists the tensors in the dict's order; their bytes are laid out by decreasing item size, so that every
    tensor is aligned to its item size in a memory map. `metadata` is free text (str -> str) kept in "__metadata__".
    """
    p = os.fspath(path)
    if not isinstance(tensors, Mapping):
        raise DeepxError(f"save_safetensors: expected a dict of name -> numpy array, not a {type(tensors).__name__}")
    arrays: list[tuple[str, np.ndarray, str]] = []
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise DeepxError(f"save_safetensors: tensor names must be strings, not {type(name).__name__} ({name!r})")
        if name == _METADATA:
            raise DeepxError(f"save_safetensors: '{_METADATA}' is reserved by the safetensors format")
        if not isinstance(value, (np.ndarray, np.generic)):
            raise DeepxError(f"save_safetensors: '{name}' is a {type(value).__name__}, not a numpy array")
        a = np.asarray(value)
        table, st_names, _ = _safetensors_dtypes()
        st = st_names.get(a.dtype.newbyteorder("="))
        if st is None:
            raise DeepxError(
                f"save_safetensors: '{name}' has numpy dtype {a.dtype}, which safetensors cannot hold; "
                f"known: {', '.join(str(d) for d in table.values())}"
            )
        arrays.append((name, a, st))
    header: dict[str, Any] = {}
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise DeepxError("save_safetensors: metadata must be a dict of str -> str")
        header[_METADATA] = dict(metadata)
    layout = sorted(range(len(arrays)), key=lambda i: -arrays[i][1].dtype.itemsize)  # stable: dict order per size
    offsets: dict[int, tuple[int, int]] = {}
    pos = 0
    for i in layout:
        offsets[i] = (pos, pos + arrays[i][1].nbytes)
        pos += arrays[i][1].nbytes
    for i, (name, a, st) in enumerate(arrays):
        header[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": list(offsets[i])}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    target = Path(p)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for i in layout:
                a = arrays[i][1]
                if a.size == 0:
                    continue
                a = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False))
                f.write(a.reshape(-1).view(np.uint8).data)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DeepxError(f"cannot write {p}: {e}") from None


def load_safetensors(path: PathLike, *, mmap: bool = True) -> dict[str, np.ndarray]:
    """Read a safetensors file as name -> numpy array, in the header's order.

    With `mmap` (the default) the arrays are read-only views of a memory map of the file (zero-copy: pages are read
    when touched); otherwise of one bytes object with the file's contents. The header is checked in full first:
    dtypes, shapes, byte counts, and data offsets that must tile the data section exactly (no overlap, no hole, no
    byte past its end).
    """
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            entries, _, start = _read_header(f, size, p)
            buffer: Any
            if mmap and size > 0:
                buffer = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ)
            else:
                f.seek(0)
                buffer = f.read()
    except FileNotFoundError:
        raise DeepxError(f"safetensors file {p} not found") from None
    except IsADirectoryError:
        raise DeepxError(f"{p} is a directory, not a safetensors file") from None
    except OSError as e:
        raise DeepxError(f"cannot read {p}: {e}") from None
    out: dict[str, np.ndarray] = {}
    for name, dtype, shape, begin, _end in entries:
        n = numel(shape)
        if n == 0:
            out[name] = np.empty(shape, dtype=dtype)
            continue
        array = np.frombuffer(buffer, dtype=dtype.newbyteorder("<"), count=n, offset=start + begin).reshape(shape)
        if sys.byteorder != "little" and dtype.itemsize > 1:
            array = array.astype(dtype)
        out[name] = array
    return out


def safetensors_metadata(path: PathLike) -> dict[str, str]:
    """The "__metadata__" of a safetensors file (empty when it has none)."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            _, metadata, _ = _read_header(f, os.fstat(f.fileno()).st_size, p)
    except FileNotFoundError:
        raise DeepxError(f"safetensors file {p} not found") from None
    except OSError as e:
        raise DeepxError(f"cannot read {p}: {e}") from None
    return metadata


_Entry = tuple[str, np.dtype, tuple[int, ...], int, int]


def _read_header(f: Any, size: int, p: str) -> tuple[list[_Entry], dict[str, str], int]:
    """The checked entries (name, dtype, shape, begin, end), the metadata, and where the data section starts."""
    if size < 8:
        raise DeepxError(f"{p} is not a safetensors file: {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > _MAX_HEADER:
        raise DeepxError(f"{p} is not a safetensors file: it claims a {n}-byte header (at most {_MAX_HEADER})")
    if n > size - 8:
        raise DeepxError(f"{p} is truncated: it claims a {n}-byte header, but only {size - 8} bytes follow")
    raw = f.read(n)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise DeepxError(f"{p}: the safetensors header names {e} twice") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise DeepxError(f"{p} is not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise DeepxError(f"{p}: the safetensors header must be a JSON object, not {type(doc).__name__}")
    start = 8 + n
    data_len = size - start
    metadata = doc.pop(_METADATA, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DeepxError(f"{p}: '{_METADATA}' must be an object of str -> str")
    entries: list[_Entry] = []
    for name, info in doc.items():
        entries.append(_entry(p, name, info))
    for name, _, _, begin, end in entries:
        if end > data_len:
            raise DeepxError(
                f"{p} is truncated or its offsets are wrong: tensor '{name}' has data_offsets [{begin}, {end}], "
                f"past the end of the {data_len}-byte data section"
            )
    pos, prev = 0, None
    for name, _, _, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin < pos:
            raise DeepxError(
                f"{p}: the data of tensors '{prev}' and '{name}' overlap (data_offsets of '{name}' start at {begin}, "
                f"before {pos})"
            )
        if begin > pos:
            raise DeepxError(f"{p}: bytes [{pos}, {begin}) of the data section belong to no tensor")
        pos, prev = end, name
    if pos != data_len:
        raise DeepxError(f"{p}: {data_len - pos} bytes after the last tensor's data belong to no tensor")
    return entries, metadata, start


def _entry(p: str, name: str, info: Any) -> _Entry:
    if not isinstance(info, dict):
        raise DeepxError(f"{p}: header entry '{name}' must be an object with dtype, shape and data_offsets")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise DeepxError(f"{p}: header entry '{name}' lacks {', '.join(missing)}")
    table = _safetensors_dtypes()[0]
    dtype = table.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise DeepxError(
            f"{p}: tensor '{name}' has dtype {info['dtype']!r}, which deepx cannot read; "
            f"known: {', '.join(table)}"
        )
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise DeepxError(f"{p}: tensor '{name}' has shape {shape!r}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise DeepxError(f"{p}: tensor '{name}' has data_offsets {offsets!r}, not [begin, end] with begin <= end")
    begin, end = offsets
    want = numel(shape) * dtype.itemsize
    if end - begin != want:
        raise DeepxError(
            f"{p}: tensor '{name}' is {info['dtype']}{shape}, {want} bytes, but its data_offsets [{begin}, {end}] "
            f"hold {end - begin}"
        )
    return name, dtype, tuple(shape), begin, end


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(repr(k))
        out[k] = v
    return out
