"""The deepx tensor file format (deepxir.md section 5): `P.shape` (YAML) beside `P.data` (raw little-endian bytes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import yaml

from deepx_sdk.errors import DeepxError
from deepx_sdk.ir.dtypes import from_numpy, to_numpy
from deepx_sdk.ir.shapes import numel


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def shape_doc(shape: tuple[int, ...], dtype: str) -> dict:
    return {"dtype": dtype, "dim": len(shape), "shape": list(shape), "stride": _contiguous_strides(shape),
            "size": numel(shape)}


def write_tensor(base: str | os.PathLike[str], array: np.ndarray) -> None:
    """Write `array` as `base.shape` and `base.data`; the data file is replaced atomically."""
    base = str(base)
    dtype = from_numpy(array.dtype)
    data = np.ascontiguousarray(array)
    if sys.byteorder != "little" and data.dtype.itemsize > 1:
        data = data.byteswap()
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    tmp = base + ".data.tmp"
    with open(tmp, "wb") as f:
        f.write(data.reshape(-1).view(np.uint8).data if data.size else b"")
    os.replace(tmp, base + ".data")
    with open(base + ".shape", "w") as f:
        yaml.safe_dump(shape_doc(tuple(array.shape), dtype), f, default_flow_style=None, sort_keys=False)


def read_shape(base: str | os.PathLike[str]) -> tuple[tuple[int, ...], str]:
    """Shape and dtype from `base.shape`, checked: stride and size must agree with the shape."""
    path = f"{base}.shape"
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise DeepxError(f"tensor file {path} not found") from None
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


def read_data(path: str | os.PathLike[str], shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Exactly numel(shape) elements of `dtype` from the raw file at `path`."""
    npdt = to_numpy(dtype).newbyteorder("<")
    want = numel(shape) * npdt.itemsize
    try:
        size = os.path.getsize(path)
        if size != want:
            raise DeepxError(
                f"{path} holds {size} bytes, but {dtype}{list(shape)} needs exactly {want}"
            )
        array = np.fromfile(path, dtype=npdt, count=numel(shape))
    except FileNotFoundError:
        raise DeepxError(f"tensor data file {path} not found") from None
    except OSError as e:
        raise DeepxError(f"cannot read {path}: {e}") from None
    return array.astype(to_numpy(dtype), copy=False).reshape(shape)


def read_tensor(base: str | os.PathLike[str]) -> np.ndarray:
    shape, dtype = read_shape(base)
    return read_data(f"{base}.data", shape, dtype)
