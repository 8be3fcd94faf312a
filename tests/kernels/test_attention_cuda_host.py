"""The CUDA attention kernels, run without a GPU: their CUDA C (deepxd/kernels/cuda/attention.py, without the shared
header) compiled for the host with cuda_host/cuda_host.h, which runs a block's threads as host threads (barriers for
__syncthreads and __syncwarp, an exchange buffer for the shuffles), and launched by the module's own Python
launchers through `HostDevice`, which stands in for the executor's driver calls (kernels by name and argument format,
launches, scratch memory). So the launchers' argument lists and grids, the kernels' index arithmetic, masks, online
softmax and synchronisation are checked against the CPU kernels on random inputs, float32 and float64, as is that
each kernel stays inside the dynamic shared memory it asks for. Speed, the 16-bit conversions and the real
hardware's memory model are the GPU suite's (tests/gpu/test_attention.py)."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from deepxd.kernels.cpu import attention as cpu
from deepxd.kernels.cuda import DeviceTensor
from deepxd.kernels.cuda import attention as cuda

GXX = shutil.which("g++")
NVCC = shutil.which("nvcc")
needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ (C++20, <barrier>) is not installed")

HERE = Path(__file__).parent / "cuda_host"

_MASK_SIG, _MASK_CALL = "const void* mask, int mkind, ll mb, ll mh, ll mr, ll mc", "mask, mkind, mb, mh, mr, mc"
# a host entry point per kernel: the grid, then the kernel's own arguments
_ENTRIES = {
    "attention_fwd": ("T* out, A* lse, const T* q, const T* k, const T* v, ll tq, ll tk, int d, int dv, int hq, "
                      f"int group, double scale, int causal, {_MASK_SIG}, ll rbase",
                      f"out, lse, q, k, v, tq, tk, d, dv, hq, group, scale, causal, {_MASK_CALL}, rbase"),
    "attention_rowdot": ("A* dd, const T* o, const T* g, ll rows, int dv", "dd, o, g, rows, dv"),
    "attention_dq": ("T* dq, const T* q, const T* k, const T* v, const T* g, const A* lse, const A* dd, ll tq, ll tk, "
                     f"int d, int dv, int hq, int group, double scale, int causal, {_MASK_SIG}, ll rbase",
                     f"dq, q, k, v, g, lse, dd, tq, tk, d, dv, hq, group, scale, causal, {_MASK_CALL}, rbase"),
    "attention_dkdv": ("T* dk, T* dvo, const T* q, const T* k, const T* v, const T* g, const A* lse, const A* dd, "
                       f"ll tq, ll tk, int d, int dv, int hq, int group, double scale, int causal, {_MASK_SIG}, "
                       "ll kbase",
                       f"dk, dvo, q, k, v, g, lse, dd, tq, tk, d, dv, hq, group, scale, causal, {_MASK_CALL}, kbase"),
}
_CTYPES = {"P": ctypes.c_void_p, "q": ctypes.c_longlong, "i": ctypes.c_int, "d": ctypes.c_double}
_GUARD = 4096  # bytes past a launch's shared memory that must stay as they were


def _build(tmp: Path, dtype: str, dp: int) -> ctypes.CDLL:
    params = "".join(f"constexpr int {k} = {v};\n" for k, v in cuda.tiles(dtype, dp).items())
    ctype = {"float32": "float", "float64": "double"}[dtype]
    entries = "".join(f'extern "C" void host_{name}(unsigned gx, unsigned gy, unsigned nt, {sig}) {{\n'
                      f"    launch(gx, gy, nt, [&] {{ {name}({call}); }});\n}}\n"
                      for name, (sig, call) in _ENTRIES.items())
    src = f'#include "{HERE / "cuda_host.h"}"\ntypedef {ctype} T;\n{params}{cuda._SRC}\n{entries}'
    assert cuda.source(dtype, dp).endswith(params + cuda._SRC)  # the module's source, but for the header
    path, lib = tmp / f"attention_{dtype}_{dp}.cpp", tmp / f"attention_{dtype}_{dp}.so"
    path.write_text(src)
    done = subprocess.run([GXX, "-std=c++20", "-O1", "-fPIC", "-shared", "-w", "-o", str(lib), str(path),
                           "-lpthread"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return ctypes.CDLL(str(lib))


class _Kernel:
    def __init__(self, lib: ctypes.CDLL, name: str, fmt: str) -> None:
        self.entry = getattr(lib, f"host_{name}")
        self.entry.argtypes = [ctypes.c_uint] * 3 + [_CTYPES[c] for c in fmt]
        self.smem = (ctypes.c_ubyte * (1 << 22)).in_dll(lib, "smem")
        self.allowed = 0

    def set_attribute(self, attribute: Any, value: int) -> None:
        self.allowed = value


class HostDevice:
    """What the attention launchers ask of a CudaExecutor, answered on the host: `function` gives the host-compiled
    kernel of the module's key (attention:<dtype>:<head size>), `launch` runs it over its grid (checking the block
    and the shared memory it was allowed), `alloc` gives host memory whose address stands for a device pointer."""

    arch = "host"
    max_blocks = 6

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.libs: dict[str, ctypes.CDLL] = {}
        self.kept: list[np.ndarray] = []
        self.launches: list[tuple[str, tuple[int, int, int], int]] = []
        self.cuda = SimpleNamespace(device_attribute=SimpleNamespace(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN="optin"),
                                    function_attribute=SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES="dynamic"))
        self.device = SimpleNamespace(get_attribute=lambda attribute: 227 * 1024)

    def function(self, key: str, source: str, name: str, fmt: str, what: str) -> _Kernel:
        if key not in self.libs:
            _, dtype, dp = key.split(":")
            self.libs[key] = _build(self.tmp, dtype, int(dp))
        f = _Kernel(self.libs[key], name, fmt)
        f.name = name  # type: ignore[attr-defined]
        return f

    def launch(self, op: str, f: _Kernel, grid: tuple[int, int, int], block: tuple[int, int, int], *args: Any,
               shared: int = 0) -> None:
        assert grid[2] == 1 and block[1:] == (1, 1) and block[0] % 32 == 0 and 0 < grid[1] <= 65535
        assert shared <= f.allowed or shared <= 48 * 1024, "shared memory beyond what the kernel was allowed"
        guard = np.ctypeslib.as_array(f.smem)[shared:shared + _GUARD]
        guard[...] = 0xA5
        f.entry(grid[0], grid[1], block[0], *args)
        assert (guard == 0xA5).all(), f"{f.name} wrote past its {shared} bytes of shared memory"  # type: ignore
        self.launches.append((f.name, grid, shared))  # type: ignore[attr-defined]

    def alloc(self, nbytes: int, op: str, name: str) -> int:
        buf = np.empty(max(nbytes, 1), np.uint8)
        self.kept.append(buf)
        return int(buf.ctypes.data)


def _tensor(a: np.ndarray) -> DeviceTensor:
    return DeviceTensor(a, a.ctypes.data, a.shape, a.dtype)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> HostDevice:
    return HostDevice(tmp_path_factory.mktemp("cuda-host"))


def _check(host: HostDevice, rng: np.random.Generator, dtype: str, qs: tuple[int, ...], ks: tuple[int, ...], dv: int,
           causal: bool, mask: np.ndarray | None = None) -> None:
    q, k = rng.uniform(-2, 2, qs).astype(dtype), rng.uniform(-2, 2, ks).astype(dtype)
    v, g = rng.uniform(-2, 2, (*ks[:-1], dv)).astype(dtype), rng.uniform(-1, 1, (*qs[:-1], dv)).astype(dtype)
    scale = 1 / math.sqrt(max(qs[-1], 1))
    got = [np.full((*qs[:-1], dv), np.nan, dtype), np.full(qs[:-1], np.nan, dtype), np.full(qs, np.nan, dtype),
           np.full(ks, np.nan, dtype), np.full(v.shape, np.nan, dtype)]
    want = [np.empty_like(a) for a in got]
    ins = [_tensor(a) for a in (q, k, v)]
    if mask is None:
        assert cuda.attention(host, *ins, scale, causal, _tensor(got[0]), _tensor(got[1]))  # type: ignore[arg-type]
        assert cuda.attentiongrad(host, *ins, _tensor(got[0]), _tensor(got[1]), _tensor(g), scale,  # type: ignore
                                  causal, *(_tensor(a) for a in got[2:]))
        cpu.attention(q, k, v, scale, causal, want[0], want[1])
        cpu.attentiongrad(q, k, v, want[0], want[1], g, scale, causal, *want[2:])
    else:
        m = _tensor(mask)
        assert cuda.maskedattention(host, *ins, m, scale, _tensor(got[0]), _tensor(got[1]))  # type: ignore[arg-type]
        assert cuda.maskedattentiongrad(host, *ins, m, _tensor(got[0]), _tensor(got[1]), _tensor(g),  # type: ignore
                                        scale, *(_tensor(a) for a in got[2:]))
        cpu.maskedattention(q, k, v, mask, scale, want[0], want[1])
        cpu.maskedattentiongrad(q, k, v, mask, want[0], want[1], g, scale, *want[2:])
    rtol = 1e-12 if dtype == "float64" else 2e-6
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=rtol, atol=rtol * max(1.0, float(np.abs(w[np.isfinite(w)]).max(
            initial=0.0))), err_msg=f"{name} {dtype} {qs} {ks} causal={causal}")


@needs_gxx
@pytest.mark.parametrize(("dtype", "qs", "ks", "dv", "causal"), [
    ("float32", (2, 3, 70, 64), (2, 3, 70, 64), 64, True),  # several tiles of rows and keys, causal blocks skipped
    ("float32", (1, 2, 33, 40), (1, 2, 100, 40), 24, False),  # Tq < Tk; padded head and value sizes
    ("float32", (1, 4, 66, 20), (1, 2, 66, 20), 20, True),  # grouped-query heads
    ("float32", (2, 17, 5), (2, 9, 5), 7, True),  # Tq > Tk, no head dim
    ("float64", (2, 1, 45, 30), (2, 1, 19, 30), 30, True),
    ("float64", (1, 6, 20, 16), (1, 2, 35, 16), 9, False),
    ("float32", (2, 3, 0, 8), (2, 3, 5, 8), 8, False),  # no query: dk and dv are zeros
    ("float32", (2, 4, 6), (2, 0, 6), 3, True),  # no key: zeros, lse -inf
])
def test_the_kernels_match_the_cpu_kernels(host, rng, dtype, qs, ks, dv, causal):
    _check(host, rng, dtype, qs, ks, dv, causal)


@needs_gxx
@pytest.mark.parametrize(("dtype", "qs", "ks", "dv", "ms", "kind"), [
    ("float32", (2, 3, 70, 64), (2, 3, 70, 64), 64, (70, 70), "bool"),  # one mask for every head, several tiles
    ("float32", (2, 4, 1, 20), (2, 2, 90, 20), 20, (2, 1, 1, 90), "bool"),  # a decoding step: one row, grouped
    ("float64", (1, 6, 20, 16), (1, 2, 35, 16), 9, (1, 6, 20, 35), "float"),  # a mask per head
    ("float32", (2, 17, 5), (2, 9, 5), 7, (9,), "float"),  # no head dim, a mask over keys
    ("float64", (3, 2, 12, 8), (3, 2, 12, 8), 8, (3, 1, 12, 12), "dead"),  # some rows see no key
])
def test_the_masked_kernels_match_the_cpu_kernels(host, rng, dtype, qs, ks, dv, ms, kind):
    keep = rng.random(ms) < 0.6
    if kind == "dead":
        keep[..., 3, :] = False
    mask = keep if kind != "float" else np.where(keep, rng.uniform(-1, 1, ms), -np.inf).astype(dtype)
    _check(host, rng, dtype, qs, ks, dv, False, np.ascontiguousarray(mask))


def test_a_mask_whose_batch_dims_do_not_flatten_is_left_to_the_cpu():
    """(B, X) batch dims with X broadcast and B not: no one stride over the flattened batch."""
    q = DeviceTensor(None, 0, (2, 3, 4, 5, 8), np.float32)
    assert cuda._mask_args(DeviceTensor(None, 1, (2, 1, 4, 5, 6), np.bool_), q.shape, 6) is None
    assert cuda._mask_args(DeviceTensor(None, 1, (2, 3, 1, 5, 6), np.bool_), q.shape, 6) == (1, 1, 30, 0, 6, 1)
    assert cuda._mask_args(DeviceTensor(None, 1, (5, 6), np.float32), q.shape, 6) == (1, 2, 0, 0, 6, 1)


@needs_gxx
def test_a_long_grid_is_launched_in_parts(host, rng, monkeypatch):
    """More row or key blocks than a grid's y may hold: launches of at most _GRID_Y, the offset the last argument."""
    monkeypatch.setattr(cuda, "_GRID_Y", 2)
    host.launches.clear()
    _check(host, rng, "float32", (1, 1, 150, 32), (1, 1, 130, 32), 32, True)
    fwd = [grid for name, grid, _ in host.launches if name == "attention_fwd"]
    assert [g[1] for g in fwd] == [2, 2, 1]  # 5 blocks of 32 rows
    assert all(shared == cuda.shared_bytes("float32", 32)[name] for name, _, shared in host.launches
               if name != "attention_rowdot")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the modules are compiled on a GPU machine")
@pytest.mark.parametrize(("dtype", "dp"), [("float16", 64), ("bfloat16", 128), ("float32", 32), ("float64", 256)])
def test_the_modules_compile(tmp_path, dtype, dp):
    """The modules as the executor compiles them (header included), for sm_90, no fast-math."""
    path = tmp_path / "attention.cu"
    path.write_text(cuda.source(dtype, dp))
    done = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-o", str(tmp_path / "m.cubin"),
                           str(path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
