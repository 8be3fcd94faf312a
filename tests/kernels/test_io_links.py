"""save, load and loadtensordata never open a file through a link (issue 21, item 1): a link placed beside a checked
path (`P.data.tmp`, `P.shape.tmp`, `P.data`, `P.shape`, a raw data file, a directory on the way) is refused with an
error naming the op, the tensor and the path, and the file it points to is neither written nor read."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from kernel_ref import T, V, ordered, rand, run

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import STORABLE, to_numpy
from deepx_core.tensorfile import open_directory, read_tensor, write_tensor
from deepxd.kernels.cpu import CpuExecutor

SECRET = b"root:secret-password-hash\n" * 4  # 104 bytes: float32[26] would take it whole
VICTIM = b"do not overwrite me\n"


@pytest.fixture
def box(tmp_path: Path) -> tuple[CpuExecutor, Path, Path]:
    """An executor whose only io root is `root`, holding float32 'x'; `outside` is a directory beside the root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    ex = CpuExecutor(io_roots=[root])
    ex.put("x", np.arange(26, dtype=np.float32))
    return ex, root, outside


def _shape_file(path: Path, n: int = 26) -> None:
    path.write_text(f"dtype: float32\ndim: 1\nshape: [{n}]\nstride: [1]\nsize: {n}\n")


@pytest.mark.parametrize("beside", [".data.tmp", ".shape.tmp"])
def test_save_refuses_a_link_where_it_writes_first(box, beside):
    ex, root, outside = box
    victim = outside / "victim"
    victim.write_bytes(VICTIM)
    os.symlink(victim, root / f"m{beside}")
    with pytest.raises(DeepxError) as caught:
        run(ex, "save", [T("x"), V(str(root / "m"))])
    msg = str(caught.value)
    assert msg.startswith("save: cannot write 'x' to ") and str(root / "m") in msg, msg
    assert f"{root / 'm'}{beside} is a symbolic link" in msg, msg
    assert victim.read_bytes() == VICTIM
    assert (root / f"m{beside}").is_symlink(), "the link is the user's to remove"


@pytest.mark.parametrize("beside", [".data", ".shape"])
def test_save_replaces_a_linked_file_and_leaves_its_target_alone(box, beside):
    """The atomic rename replaces a link at P.data or P.shape itself, never the file it points to."""
    ex, root, outside = box
    victim = outside / "victim"
    victim.write_bytes(VICTIM)
    os.symlink(victim, root / f"m{beside}")
    run(ex, "save", [T("x"), V(str(root / "m"))])
    assert victim.read_bytes() == VICTIM
    assert not (root / f"m{beside}").is_symlink()
    assert sorted(p.name for p in root.iterdir()) == ["m.data", "m.shape"]
    run(ex, "load", [V(str(root / "m"))], [T("y")])
    np.testing.assert_array_equal(ex.get("y"), ex.get("x"))


def test_load_refuses_a_linked_data_file_and_reads_no_secret(box):
    ex, root, outside = box
    (outside / "secret").write_bytes(SECRET)
    _shape_file(root / "s.shape")
    os.symlink(outside / "secret", root / "s.data")
    with pytest.raises(DeepxError) as caught:
        run(ex, "load", [V(str(root / "s"))])
    msg = str(caught.value)
    assert msg.startswith(f"load: cannot read 's' from {root / 's'}: {root / 's.data'} is a symbolic link"), msg
    assert "s" not in ex.tensors
    assert "secret" not in msg


def test_load_refuses_a_linked_shape_file(box):
    ex, root, outside = box
    _shape_file(outside / "t.shape")
    (root / "t.data").write_bytes(np.zeros(26, np.float32).tobytes())
    os.symlink(outside / "t.shape", root / "t.shape")
    with pytest.raises(DeepxError, match=r"load: cannot read 'w' from .*t\.shape is a symbolic link"):
        run(ex, "load", [V(str(root / "t"))], [T("w")])
    assert "w" not in ex.tensors


def test_loadtensordata_refuses_a_linked_file_and_leaves_the_tensor(box):
    ex, root, outside = box
    (outside / "secret").write_bytes(SECRET)
    os.symlink(outside / "secret", root / "raw.bin")
    before = ex.get("x").copy()
    with pytest.raises(DeepxError, match=r"loadtensordata: cannot read 'x' from .*raw\.bin is a symbolic link"):
        run(ex, "loadtensordata", [V(str(root / "raw.bin"))], [T("x")])
    np.testing.assert_array_equal(ex.get("x"), before)


@pytest.mark.parametrize("op", ["save", "load", "loadtensordata"])
def test_a_linked_directory_inside_the_root_is_refused(box, op):
    ex, root, outside = box
    (outside / "a.data").write_bytes(SECRET)
    _shape_file(outside / "a.shape")
    os.symlink(outside, root / "sub")
    before = sorted(p.name for p in outside.iterdir())
    with pytest.raises(DeepxError, match=rf"{op} of '(x|a)': path .* is outside the allowed io roots"):
        if op == "save":
            run(ex, "save", [T("x"), V(str(root / "sub" / "new"))])
        elif op == "load":
            run(ex, "load", [V(str(root / "sub" / "a"))])
        else:
            run(ex, "loadtensordata", [V(str(root / "sub" / "a.data"))], [T("x")])
    assert sorted(p.name for p in outside.iterdir()) == before
    assert "a" not in ex.tensors


def test_a_directory_swapped_for_a_link_after_the_check_is_not_followed(box):
    """The race the io root check alone loses: the directory was checked, then became a link. open_directory walks the
    resolved path one component at a time without following links, so it refuses instead of opening `outside`."""
    _, root, outside = box
    (root / "sub").mkdir()
    checked = (root / "sub").resolve()
    os.rmdir(root / "sub")
    os.symlink(outside, root / "sub")
    with pytest.raises(DeepxError, match=r"sub is a symbolic link, where a directory was checked"):
        open_directory(checked)
    with pytest.raises(DeepxError, match=r"sub is a symbolic link"):
        open_directory(checked / "deeper", create=True)
    assert list(outside.iterdir()) == []


def test_a_fifo_is_refused_without_hanging(box):
    ex, root, _ = box
    _shape_file(root / "f.shape")
    os.mkfifo(root / "f.data")
    done: list[BaseException] = []

    def load() -> None:
        try:
            run(ex, "load", [V(str(root / "f"))])
        except BaseException as e:  # handed to the test's thread
            done.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "load of a FIFO hung"
    assert done and isinstance(done[0], DeepxError) and "f.data is a FIFO, not a regular file" in str(done[0])


def test_a_directory_where_the_tmp_file_goes_is_refused(box):
    ex, root, _ = box
    (root / "d.data.tmp").mkdir()
    with pytest.raises(DeepxError, match=r"d\.data\.tmp is a directory, not a regular file"):
        run(ex, "save", [T("x"), V(str(root / "d"))])


def test_a_tmp_file_a_dead_save_left_is_replaced(box):
    ex, root, _ = box
    (root / "m.data.tmp").write_bytes(b"half of an old save")
    run(ex, "save", [T("x"), V(str(root / "m"))])
    assert sorted(p.name for p in root.iterdir()) == ["m.data", "m.shape"]


def test_save_makes_missing_directories_inside_the_root(box):
    ex, root, _ = box
    run(ex, "save", [T("x"), V(str(root / "a" / "b" / "m"))])
    run(ex, "load", [V(str(root / "a" / "b" / "m"))], [T("y")])
    np.testing.assert_array_equal(ex.get("y"), ex.get("x"))


def test_a_path_naming_a_directory_is_refused(box):
    ex, root, _ = box
    with pytest.raises(DeepxError, match=r"save of 'x': path .* names a directory"):
        run(ex, "save", [T("x"), V(str(root) + "/..")])


@pytest.mark.parametrize("dtype", ordered(STORABLE))
def test_save_load_inside_a_root_round_trips_bit_exact(box, dtype, rng):
    ex, root, _ = box
    for i, shape in enumerate([(3, 5), (), (0, 2), (2, 1, 3)]):
        a = rand(rng, dtype, shape, -50, 50)
        if a.dtype.kind == "f" and a.size:
            a.reshape(-1)[0] = np.nan  # nan's bits too
        ex.put("a", a)
        base = root / "nested" / f"t{i}"
        run(ex, "save", [T("a", dtype), V(str(base))])
        run(ex, "load", [V(str(base))], [T("b")])
        got = ex.get("b")
        assert got.dtype == to_numpy(dtype) and got.shape == shape
        assert got.tobytes() == a.tobytes(), f"{dtype}{list(shape)} not bit-exact"
        ex.put("c", np.zeros(shape, to_numpy(dtype)))
        run(ex, "loadtensordata", [V(str(base) + ".data")], [T("c", dtype)])
        assert ex.get("c").tobytes() == a.tobytes()


def test_the_sdk_file_functions_refuse_links_too(tmp_path):
    """deepx_core.tensorfile's plain-path functions (dx.save and dx.load) go the same way."""
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    os.symlink(victim, tmp_path / "m.data.tmp")
    with pytest.raises(DeepxError, match=r"m\.data\.tmp is a symbolic link"):
        write_tensor(tmp_path / "m", np.ones(3, np.float32))
    assert victim.read_bytes() == VICTIM
    os.unlink(tmp_path / "m.data.tmp")
    write_tensor(tmp_path / "m", np.ones(3, np.float32))
    os.replace(tmp_path / "m.data", tmp_path / "real.data")
    os.symlink(tmp_path / "real.data", tmp_path / "m.data")
    with pytest.raises(DeepxError, match=r"m\.data is a symbolic link"):
        read_tensor(tmp_path / "m")


def test_a_hard_linked_tensor_file_is_not_read(tmp_path: Path) -> None:
    """A hard link is a regular file: one to a file outside the io root (where fs.protected_hardlinks allows it) is
    refused by its link count."""
    from deepx_core.tensorfile import read_tensor, write_tensor

    write_tensor(tmp_path / "t", np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(read_tensor(tmp_path / "t"), np.arange(3, dtype=np.float32))
    os.link(tmp_path / "t.data", tmp_path / "elsewhere.data")
    with pytest.raises(DeepxError, match="has 2 hard links"):
        read_tensor(tmp_path / "t")
