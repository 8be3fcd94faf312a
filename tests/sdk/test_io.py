"""deepx_sdk.io: the deepx tensor file format and safetensors, against the real `safetensors` package and torch."""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import yaml

import deepx_sdk as dx
from deepx_core.errors import DeepxError
from deepx_core.tensorfile import read_tensor
from deepx_sdk.io import load, load_safetensors, safetensors_metadata, save, save_safetensors

STORABLE = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
    "float8e5m2": ml_dtypes.float8_e5m2, "float8e4m3": ml_dtypes.float8_e4m3fn, "int64": np.int64,
    "int32": np.int32, "int16": np.int16, "int8": np.int8, "bool": np.bool_,
}


def sample(dtype: Any, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return np.asarray(rng.random(shape) < 0.5)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.asarray(rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True))
    return np.asarray((rng.standard_normal(shape) * 3).astype(np.float32).astype(dt))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes (NaNs included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def header_of(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0  # the data section starts 8-byte aligned
    return dict(json.loads(raw[8:8 + n]))


def raw_file(path: Path, header: Any, data: bytes = b"") -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


# ---------------------------------------------------------------- deepx tensor files


@pytest.mark.parametrize("shape", [(2, 3), (), (0, 4), (2, 1, 3)])
@pytest.mark.parametrize("precision", list(STORABLE))
def test_deepx_file_round_trip(tmp_path: Path, precision: str, shape: tuple[int, ...]) -> None:
    a = sample(STORABLE[precision], shape)
    save(dx.tensor(a), tmp_path / "t")
    t = load(tmp_path / "t")
    assert isinstance(t, dx.Tensor)
    assert t.dtype == precision and t.shape == shape
    assert same(t.numpy().reshape(shape), a)


def test_deepx_file_fields(tmp_path: Path) -> None:
    x = dx.arange(24, dtype=dx.bfloat16).reshape(2, 3, 4) * 0.5
    save(x, tmp_path / "sub" / "x")  # parent directories are created
    doc = yaml.safe_load((tmp_path / "sub" / "x.shape").read_text())
    assert doc == {"dtype": "bfloat16", "dim": 3, "shape": [2, 3, 4], "stride": [12, 4, 1], "size": 24}
    data = (tmp_path / "sub" / "x.data").read_bytes()
    assert len(data) == 24 * 2
    assert same(np.frombuffer(data, "<u2").view(ml_dtypes.bfloat16).reshape(2, 3, 4), x.numpy())
    assert same(read_tensor(tmp_path / "sub" / "x"), x.numpy())  # what other deepx programs read

    save(np.array([True, False, True]), tmp_path / "b")  # a numpy array saves the same way
    assert yaml.safe_load((tmp_path / "b.shape").read_text()) == {
        "dtype": "bool", "dim": 1, "shape": [3], "stride": [1], "size": 3}
    assert (tmp_path / "b.data").read_bytes() == b"\x01\x00\x01"

    save(np.float64(2.5), tmp_path / "s")  # a 0-d tensor
    assert yaml.safe_load((tmp_path / "s.shape").read_text()) == {
        "dtype": "float64", "dim": 0, "shape": [], "stride": [], "size": 1}
    assert (tmp_path / "s.data").read_bytes() == struct.pack("<d", 2.5)


def test_deepx_file_accepts_shape_or_data_name(tmp_path: Path) -> None:
    a = sample(np.int32, (5,))
    save(a, tmp_path / "w")
    for name in ("w", "w.shape", "w.data"):
        t = load(tmp_path / name)
        assert isinstance(t, dx.Tensor) and same(t.numpy(), a)
    save(a * 2, str(tmp_path / "w.shape"))  # the same base
    assert same(load(tmp_path / "w").numpy(), a * 2)  # type: ignore[union-attr]


def test_deepx_file_key_order_free(tmp_path: Path) -> None:
    (tmp_path / "k.shape").write_text("size: 2\nshape: [2]\ndtype: int16\nstride: [1]\ndim: 1\n")
    (tmp_path / "k.data").write_bytes(struct.pack("<hh", -3, 7))
    assert load(tmp_path / "k").tolist() == [-3, 7]  # type: ignore[union-attr]


# ---------------------------------------------------------------- safetensors: our own files


def test_state_dict_round_trip_every_dtype(tmp_path: Path) -> None:
    names = [f"layer{9 - i}.{p}" for i, p in enumerate(STORABLE)]  # not sorted, mixed item sizes
    arrays = {n: sample(dt, (3, i + 1), seed=i) for i, (n, dt) in enumerate(zip(names, STORABLE.values()))}
    arrays["scalar"] = sample(np.float32, ())
    arrays["empty"] = np.zeros((0, 2), np.int64)
    sd = {k: dx.tensor(v) for k, v in arrays.items()}
    save(sd, tmp_path / "model.safetensors")
    back = load(tmp_path / "model.safetensors")
    assert isinstance(back, dict) and list(back) == list(arrays)  # the dict's order
    for k, a in arrays.items():
        assert back[k].dtype == sd[k].dtype and back[k].shape == a.shape
        assert same(back[k].numpy().reshape(a.shape), a), k
    np_back = load_safetensors(tmp_path / "model.safetensors")
    assert list(np_back) == list(arrays) and all(same(np_back[k], a) for k, a in arrays.items())


def test_layout_is_aligned(tmp_path: Path) -> None:
    tensors = {"b": np.ones(3, np.bool_), "d": np.ones(3, np.float64), "h": np.ones(5, np.float16),
               "i": np.ones(1, np.int32)}
    save_safetensors(tensors, tmp_path / "a.safetensors", metadata={"format": "np"})
    header = header_of(tmp_path / "a.safetensors")
    assert list(header) == ["__metadata__", "b", "d", "h", "i"]
    assert header["__metadata__"] == {"format": "np"}
    for name, info in header.items():
        if name != "__metadata__":
            assert info["data_offsets"][0] % tensors[name].dtype.itemsize == 0, name
    assert safetensors_metadata(tmp_path / "a.safetensors") == {"format": "np"}
    assert safetensors_metadata(raw_file(tmp_path / "none.safetensors", {})) == {}


def test_load_safetensors_is_zero_copy(tmp_path: Path) -> None:
    a = sample(np.float32, (64, 64))
    save_safetensors({"a": a, "b": a[::2, ::3]}, tmp_path / "z.safetensors")  # non-contiguous input is fine
    out = load_safetensors(tmp_path / "z.safetensors")
    base = out["a"]
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap) and not out["a"].flags.writeable
    assert same(out["a"], a) and same(out["b"], np.ascontiguousarray(a[::2, ::3]))
    copy = load_safetensors(tmp_path / "z.safetensors", mmap=False)
    assert same(copy["a"], a) and not copy["a"].flags.writeable
    # saving over the file replaces it: arrays mapped from the old one stay valid
    save_safetensors({"a": np.zeros(1, np.float32)}, tmp_path / "z.safetensors")
    assert same(out["a"], a)


def test_single_tensor_to_safetensors(tmp_path: Path) -> None:
    x = dx.tensor(sample(np.float16, (4,)))
    save(x, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors.shape").exists()
    back = load(tmp_path / "x.safetensors")
    assert isinstance(back, dict) and list(back) == ["tensor"] and same(back["tensor"].numpy(), x.numpy())


def test_dict_format_named_by_dictness(tmp_path: Path) -> None:
    save({"w": np.arange(3, dtype=np.int64)}, tmp_path / "weights.bin")  # any name: a dict is safetensors
    back = load(tmp_path / "weights.bin")
    assert isinstance(back, dict) and back["w"].tolist() == [0, 1, 2]


def test_save_reads_lazy_tensors(tmp_path: Path) -> None:
    w = dx.ones(3, 2, requires_grad=True)
    y = (dx.arange(6, dtype=dx.float32).reshape(2, 3) @ w).relu()
    total = y.sum()
    zero_d = dx.tensor(np.array(7, np.int16))
    save({"w": w, "y": y, "total": total, "alias": w, "zero_d": zero_d}, tmp_path / "s.safetensors")
    out = load_safetensors(tmp_path / "s.safetensors")
    assert same(out["y"], np.array([[3, 3], [12, 12]], np.float32))
    assert same(out["total"], np.float32(30).reshape(())) and same(out["alias"], out["w"])
    assert same(out["zero_d"], np.array(7, np.int16))


# ---------------------------------------------------------------- the real safetensors package


def test_interop_with_safetensors_numpy(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    # dtypes safetensors.numpy knows (it has no BF16 or F8 reader), plus unsigned ones deepx cannot hold
    kinds = [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.bool_, np.uint8,
             np.uint16, np.uint32, np.uint64]
    arrays = {f"t{i}": sample(k, (2, i % 3 + 1), seed=i) for i, k in enumerate(kinds)}
    arrays["empty"] = np.zeros((0,), np.float32)
    arrays["scalar"] = np.array(1.5, np.float64)

    save_safetensors(arrays, tmp_path / "ours.safetensors", metadata={"who": "deepx"})
    theirs = load_file(tmp_path / "ours.safetensors")
    assert set(theirs) == set(arrays) and all(same(theirs[k], a) for k, a in arrays.items())
    with safe_open(tmp_path / "ours.safetensors", framework="np") as f:
        assert f.metadata() == {"who": "deepx"}

    save_file(arrays, tmp_path / "theirs.safetensors", metadata={"who": "safetensors"})
    ours = load_safetensors(tmp_path / "theirs.safetensors")
    assert list(ours) == [k for k in header_of(tmp_path / "theirs.safetensors") if k != "__metadata__"]
    assert all(same(ours[k], a) for k, a in arrays.items())
    assert safetensors_metadata(tmp_path / "theirs.safetensors") == {"who": "safetensors"}

    # its writer takes ml_dtypes arrays: bfloat16 and float8 files read back identically
    low = {"bf": sample(ml_dtypes.bfloat16, (5,)), "e5": sample(ml_dtypes.float8_e5m2, (2, 2)),
           "e4": sample(ml_dtypes.float8_e4m3fn, (3,))}
    save_file(low, tmp_path / "low.safetensors")
    back = load(tmp_path / "low.safetensors")
    assert isinstance(back, dict) and all(same(back[k].numpy(), a) for k, a in low.items())


def test_interop_with_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4))
    model.register_buffer("mask", torch.rand(4) < 0.5)
    model.register_buffer("steps", torch.tensor(12345, dtype=torch.int64))
    model.register_buffer("bf16", torch.randn(3, dtype=torch.bfloat16))
    model.register_buffer("fp8", torch.randn(3).to(torch.float8_e4m3fn))
    model.register_buffer("fp8b", torch.randn(2, 2).to(torch.float8_e5m2))
    model.register_buffer("f16", torch.randn(2, dtype=torch.float16))
    model.register_buffer("i8", torch.tensor([-128, 0, 127], dtype=torch.int8))
    model.register_buffer("i16", torch.tensor([-3, 300], dtype=torch.int16))
    model.register_buffer("i32", torch.tensor([1 << 30], dtype=torch.int32))
    model.register_buffer("f64", torch.randn(2, dtype=torch.float64))
    views = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}

    def torch_bytes(t: Any) -> bytes:
        t = t.detach().contiguous()
        return bytes(t.view(views[t.dtype]).numpy().tobytes()) if t.dtype in views else t.numpy().tobytes()

    # torch -> deepx
    sd = {k: v.clone() for k, v in model.state_dict().items()}  # a copy: load_state_dict writes into the model
    save_file(sd, tmp_path / "torch.safetensors")
    loaded = load(tmp_path / "torch.safetensors")
    assert isinstance(loaded, dict) and set(loaded) == set(sd)
    for k, v in sd.items():
        assert loaded[k].shape == tuple(v.shape), k
        assert loaded[k].numpy().reshape(loaded[k].shape).tobytes() == torch_bytes(v), k
    assert loaded["bf16"].dtype == "bfloat16" and loaded["fp8"].dtype == "float8e4m3"
    assert loaded["mask"].dtype == "bool" and loaded["steps"].item() == 12345

    # deepx -> torch: change the weights in deepx, save, load into the torch model
    changed = {k: (t * 2 if t.dtype in ("float32", "float64") else t) for k, t in loaded.items()}
    save(changed, tmp_path / "deepx.safetensors")
    back = load_file(tmp_path / "deepx.safetensors")
    model.load_state_dict(back, strict=True)
    for k, v in model.state_dict().items():
        assert v.dtype == sd[k].dtype, k
        want = sd[k] * 2 if sd[k].dtype in (torch.float32, torch.float64) else sd[k]
        assert torch_bytes(v) == torch_bytes(want), k


# ---------------------------------------------------------------- errors


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(DeepxError, match=r"no tensor file at .*nope.*nope\.shape"):
        load(tmp_path / "nope")
    with pytest.raises(DeepxError, match="not found"):
        load(tmp_path / "nope.safetensors")
    with pytest.raises(DeepxError, match="not found"):
        load_safetensors(tmp_path / "nope.safetensors")
    (tmp_path / "half.shape").write_text("dtype: float32\nshape: [2]\n")
    with pytest.raises(DeepxError, match=r"half\.data not found"):
        load(tmp_path / "half")
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(DeepxError, match="is a directory"):
        load(tmp_path / "dir.safetensors")


def test_deepx_file_errors(tmp_path: Path) -> None:
    save(np.arange(4, dtype=np.float32), tmp_path / "t")
    (tmp_path / "t.data").write_bytes((tmp_path / "t.data").read_bytes()[:-1])
    with pytest.raises(DeepxError, match=r"holds 15 bytes.*needs exactly 16"):
        load(tmp_path / "t")
    (tmp_path / "u.shape").write_text("dtype: int4\nshape: [2]\n")
    (tmp_path / "u.data").write_bytes(b"\x00")
    with pytest.raises(DeepxError, match="no storage"):
        load(tmp_path / "u")
    (tmp_path / "s.shape").write_text("dtype: float32\nshape: [2, 3]\nstride: [1, 2]\n")
    with pytest.raises(DeepxError, match="stride"):
        load(tmp_path / "s")
    (tmp_path / "y.shape").write_text("[not, a, mapping]")
    with pytest.raises(DeepxError, match="mapping"):
        load(tmp_path / "y")


def test_save_errors(tmp_path: Path) -> None:
    with pytest.raises(DeepxError, match=r"uint8.*no deepx precision"):
        save(np.zeros(3, np.uint8), tmp_path / "u")
    with pytest.raises(DeepxError, match=r"'w'.*uint16"):
        save({"w": np.zeros(3, np.uint16)}, tmp_path / "u.safetensors")
    with pytest.raises(DeepxError, match="flat dict"):
        save({"state": {"x": np.zeros(1, np.float32)}}, tmp_path / "o.safetensors")
    with pytest.raises(DeepxError, match="keys must be strings"):
        save({1: np.zeros(1, np.float32)}, tmp_path / "o.safetensors")
    with pytest.raises(DeepxError, match="cannot save a list"):
        save([np.zeros(1)], tmp_path / "l")
    with pytest.raises(DeepxError, match="reserved"):
        save_safetensors({"__metadata__": np.zeros(1)}, tmp_path / "m.safetensors")
    with pytest.raises(DeepxError, match="metadata must be"):
        save_safetensors({"a": np.zeros(1)}, tmp_path / "m.safetensors", metadata={"n": 1})  # type: ignore[dict-item]
    with pytest.raises(DeepxError, match="complex128"):
        save_safetensors({"a": np.zeros(1, np.complex128)}, tmp_path / "m.safetensors")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_dtype_deepx_cannot_store(tmp_path: Path) -> None:
    save_safetensors({"ok": np.ones(2, np.float32), "bytes": np.arange(4, dtype=np.uint8)}, tmp_path / "u.safetensors")
    with pytest.raises(DeepxError, match=r"'bytes' has dtype U8, which deepx cannot store.*load_safetensors"):
        load(tmp_path / "u.safetensors")
    assert load_safetensors(tmp_path / "u.safetensors")["bytes"].tolist() == [0, 1, 2, 3]
    raw_file(tmp_path / "f4.safetensors", {"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\x00")
    with pytest.raises(DeepxError, match="'x' has dtype 'F4', which deepx cannot read"):
        load(tmp_path / "f4.safetensors")


def entry(dtype: str = "F32", shape: list[int] | None = None, offsets: list[int] | None = None) -> dict[str, Any]:
    return {"dtype": dtype, "shape": [2] if shape is None else shape, "data_offsets": offsets or [0, 8]}


@pytest.mark.parametrize(("header", "data", "message"), [
    (b"", None, "shorter than the 8-byte header length"),
    (b"not json", b"", "header is not JSON"),
    (b"[1, 2]", b"", "must be a JSON object"),
    (b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": 1}', b"", "names 'a' twice"),
    (b"\xff\xfe", b"", "not JSON"),
    ({"a": [1]}, b"", "'a' must be an object"),
    ({"a": {"dtype": "F32"}}, b"", "lacks shape, data_offsets"),
    ({"a": entry(shape=[-1])}, b"", "not a list of non-negative integers"),
    ({"a": entry(shape=[2.0])}, b"", "not a list of non-negative integers"),
    ({"a": entry(offsets=[8, 0])}, b"", r"begin <= end"),
    ({"a": entry(offsets=[0, 4])}, bytes(4), r"F32\[2\], 8 bytes, but its data_offsets \[0, 4\] hold 4"),
    ({"a": entry(), "__metadata__": {"k": 1}}, bytes(8), "must be an object of str -> str"),
    ({"a": entry(), "b": entry(offsets=[4, 12])}, bytes(12), "'a' and 'b' overlap"),
    ({"a": entry(), "b": entry(offsets=[8, 16])}, bytes(12), r"'b' has data_offsets \[8, 16\], past the end"),
    ({"a": entry(offsets=[4, 12])}, bytes(12), r"bytes \[0, 4\) .* belong to no tensor"),
    ({"a": entry()}, bytes(10), "2 bytes after the last tensor"),
])
def test_bad_safetensors_files(tmp_path: Path, header: Any, data: bytes | None, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    if data is None:
        path.write_bytes(header)
    else:
        raw_file(path, header, data)
    with pytest.raises(DeepxError, match=message):
        load_safetensors(path)
    with pytest.raises(DeepxError, match=message):
        load(path)


def test_truncated_safetensors(tmp_path: Path) -> None:
    save({"a": np.ones((4, 4), np.float32), "b": np.ones(3, np.int64)}, tmp_path / "t.safetensors")
    raw = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(raw[:-5])
    with pytest.raises(DeepxError, match=r"truncated or its offsets are wrong: tensor 'a'"):
        load(tmp_path / "t.safetensors")
    (tmp_path / "t.safetensors").write_bytes(raw[:20])
    with pytest.raises(DeepxError, match=r"truncated: it claims a \d+-byte header, but only 12 bytes follow"):
        load(tmp_path / "t.safetensors")
    (tmp_path / "t.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(DeepxError, match="claims a 1099511627776-byte header"):
        load(tmp_path / "t.safetensors")
