"""Matrix products through Intel MKL, where it is installed (`pip install 'deepx[mkl]'`), and the OpenMP runtime
that comes with it, which the native kernels then share (native.py).

numpy's OpenBLAS runs a GEMM on one core near the machine's peak, but on two it loses 15-20% to MKL on an AVX-512
Xeon (docs/decisions/0016-mkl-by-measurement.md), and its idle workers spin on the other core, so that an
elementwise loop split across cores right after a GEMM runs many times slower. With MKL, GEMMs and the native
kernels' split loops run on one pool of threads (Intel's libiomp5, in MKL's "intel" threading layer): the worker a
GEMM leaves spinning is the one that takes the next loop's half.

    DEEPX_BLAS=auto   (the default) the faster of the two here: where the `mkl` package is installed, the first
                      start on a machine times the MLP step's largest products on each (under a second, most of it
                      pauses for the other library's threads to sleep) and keeps the choice in the kernel cache
                      (`blas-choice.json`), so that every later process makes the same one; numpy's BLAS where MKL
                      is not installed
    DEEPX_BLAS=numpy  numpy's BLAS (OpenBLAS in numpy's wheels) and native kernels on one thread
    DEEPX_BLAS=mkl    MKL, and an error at start-up where it cannot be loaded

On an AVX-512 Xeon MKL won (15-20% on the MLP step); on an AMD EPYC with AVX2 only, numpy's OpenBLAS did (its
products 6-11% faster alone, the step 0.97x torch's time against 1.22x on MKL), hence the measurement. auto also
runs small products on one thread where MKL is chosen (SMALL_WORK), and times the smallest on each, apart: those go
to numpy's BLAS where it makes them faster (NUMPY_WORK, SMALL_SHAPES).

The config's `blas` key says the same for a daemon. MKL gives other bits than OpenBLAS (another order of the
products' sums), within float32's rounding of each other; one process makes each shape of product the same way.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from deepx_core.errors import DeepxError
from deepxd.kernels.cpu import native as _native
from deepxd.kernels.cpu._util import address as _address

log = logging.getLogger(__name__)

CHOICES = ("auto", "numpy", "mkl")
# cblas enums
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_FLIP = {_NO_TRANS: _TRANS, _TRANS: _NO_TRANS}
#: a 2-D product with this many columns (inclusive range), at least NARROW_ROWS rows and a depth (the summed dim)
#: of at least NARROW_DEPTH is made as its transpose (few x rows), which MKL makes 1.2-2.5x faster (a classifier's
#: logits: 256 x 512 @ 512 x 10 in 41 us instead of 75); with a shallow depth, or 16 columns and up, the product as
#: it is does better (bench/kernels.py). The native skinny loops (native.SKINNY) take most of these first.
NARROW = (4, 15)
NARROW_ROWS = 64
NARROW_DEPTH = 256
_INT_MAX = (1 << 31) - 1  # MKL's LP64 interface: 32-bit sizes
_SMALL = _native.SKINNY_MAX  # a product with a dimension this small or smaller may be skinny (native.small_product)

_lock = threading.Lock()
_mode = os.environ.get("DEEPX_BLAS", "auto").strip().lower() or "auto"
if _mode not in CHOICES:
    log.warning("blas: DEEPX_BLAS=%r is none of %s; auto", _mode, ", ".join(CHOICES))
    _mode = "auto"
_mkl: Any = None  # the loaded libmkl_rt (a ctypes.CDLL), or None
_tried = False
_why = ""  # why MKL is not in use, for the start-up line
_lib_dir: Path | None = None  # where libiomp5 lies, for native kernels that link it
_small = False  # auto chose MKL: small products run on one thread (SMALL_WORK)
_small_numpy = False  # ...and the smallest on numpy's BLAS (NUMPY_WORK)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a parent's thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _find(dist: str, stem: str) -> Path | None:
    """The file of installed distribution `dist` whose name starts with `stem` (a shared library it installs)."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in d.files or ():
        if f.name.startswith(stem):
            p = Path(str(d.locate_file(f))).resolve()
            if p.exists():
                return p
    return None


def set_mode(mode: str) -> None:
    """auto, numpy or mkl (the config's `blas`), before the first matmul; `mkl` raises where MKL cannot be had."""
    global _mode, _tried, _mkl, _why, _small, _small_numpy
    mode = mode.strip().lower()
    if mode not in CHOICES:
        raise DeepxError(f"blas: {mode!r} must be one of {', '.join(CHOICES)}")
    with _lock:
        if mode != _mode:
            _mode = mode
            if _mkl is None:
                _tried = False  # looked for again under the new mode
            elif mode == "numpy":
                _mkl, _why = None, "blas = numpy"  # the loaded library stays loaded, unused
            if mode != "auto":
                _small = _small_numpy = False
    _native.set_split(mode != "numpy")  # kernels built with OpenMP run their serial loops under numpy's BLAS
    if mode == "mkl" and mkl() is None:
        raise DeepxError(f"blas = mkl, but MKL cannot be loaded: {_why} (pip install 'deepx[mkl]')")


def mkl() -> Any:
    """The loaded MKL library, or None (numpy's BLAS): loaded on first call."""
    global _tried
    if _tried:
        return _mkl
    with _lock:
        if not _tried:
            _load()
            _tried = True
    return _mkl


def _load() -> None:
    global _mkl, _why, _lib_dir, _small, _small_numpy
    if _mode == "numpy":
        _why = "blas = numpy"
        return
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _why = f"MKL runs on x86_64 only (this machine: {platform.machine()})"
        return
    rt, omp = _find("mkl", "libmkl_rt.so"), _find("intel-openmp", "libiomp5.so")
    if rt is None or omp is None:
        _why = "the mkl package is not installed" if rt is None else "intel-openmp (libiomp5) is not installed"
        return
    foreign = _openmp_loaded()
    if foreign is not None and Path(foreign).resolve() != omp:
        # MKL's threading layer would take omp_get_thread_num and the rest from that runtime (found first in the
        # process's global scope) and its own parallel regions from libiomp5: wrong products, not only slow ones
        _why = (f"another OpenMP runtime ({foreign}) was loaded first: start deepx before importing what "
                f"loaded it (torch, say), or set DEEPX_BLAS=numpy")
        log.warning("blas: MKL not used: %s", _why)
        return
    # an idle worker spins this many ms before it sleeps (Intel's default, 200, keeps a core busy for 0.2 s after
    # every product; back-to-back kernels are microseconds apart, and 1 ms was as fast in the MLP step)
    os.environ.setdefault("KMP_BLOCKTIME", "1")
    try:
        ctypes.CDLL(str(omp), mode=ctypes.RTLD_GLOBAL)  # one OpenMP runtime for MKL and the native kernels
        lib = ctypes.CDLL(str(rt))
        lib.MKL_Set_Interface_Layer(0)  # LP64: 32-bit sizes, as the signatures below
        lib.MKL_Set_Threading_Layer(0)  # intel: libiomp5, which survives a fork (GNU's libgomp hangs the child)
        c_int, p, f32, f64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_double
        for name, real in (("cblas_sgemm", f32), ("cblas_dgemm", f64)):
            fn = getattr(lib, name)
            fn.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, real, p, c_int, p, c_int, real, p, c_int]
            fn.restype = None
        for name, real in (("cblas_sgemm_batch_strided", f32), ("cblas_dgemm_batch_strided", f64)):
            fn = getattr(lib, name)
            fn.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, real, p, c_int, c_int, p, c_int, c_int, real,
                           p, c_int, c_int, c_int]
            fn.restype = None
        lib.MKL_Get_Max_Threads.restype = c_int
        lib.MKL_Set_Num_Threads_Local.argtypes, lib.MKL_Set_Num_Threads_Local.restype = [c_int], c_int
        # a product on the machine's threads gives the same bits whatever the arrays' alignment (MKL's conditional
        # numerical reproducibility, AUTO branch): a program and its stored graph's replay agree to the bit
        if lib.MKL_CBWR_Set(2) != 0:
            log.debug("blas: MKL_CBWR_Set(AUTO) was refused; products may differ with alignment")
    except (OSError, AttributeError) as e:
        _why = f"MKL does not load ({e})"
        log.warning("blas: %s; matmul runs on numpy's BLAS", _why)
        return
    if _mode == "auto":
        choice = _choice(lib)
        if choice["blas"] == "numpy":  # MKL stays loaded, unused; native kernels are built without OpenMP
            _why = (f"auto: numpy's BLAS is faster here, {choice['numpy_us']:.0f} us against MKL's "
                    f"{choice['mkl_us']:.0f} for the MLP step's largest products ({CHOICE_FILE})")
            _native.set_split(False)
            return
        _small, _small_numpy = True, choice.get("small_blas") == "numpy"
    _mkl, _lib_dir = lib, omp.parent
    _why = ""


#: auto's measurement: products (m, k, n) of float32, each library in blocks of its own (a warm-up, then
#: CHOICE_ROUNDS timed), two blocks each, in turn, after a pause long enough for the other library's idle threads
#: to stop spinning (back to back, each library's spinning workers slowed the other's products 1.5-3x); numpy's BLAS
#: is chosen when its total is below NUMPY_MARGIN of MKL's (MKL otherwise: it shares its threads with the native
#: kernels' split loops). The first CHOICE_TIMES starts on a machine each measure, and the choice is made on the
#: best figures of them all: one measurement, taken while something else ran (a test suite's other workers, a
#: client importing), kept a wrong choice for good (numpy's BLAS on a Xeon where MKL makes the step 1.28x faster:
#: a moment's load slows MKL's two threads, which wait for each other, more than numpy's)
CHOICE_SHAPES = ((256, 784, 512), (256, 512, 512))
#: where MKL is chosen, a 2-D product of SMALL_WORK multiply-adds or fewer runs on one thread: inside the digits MLP's
#: step (64-128-64, batch 64) MKL took 13-22 us for a 64 x 64 @ 64 x 128 product on one thread against 32-50 on two,
#: and on a loaded machine 16 us against 160 (two threads wait for each other); skinny ones too (the native loops'
#: team took 14-22 us). At NUMPY_WORK or fewer (where OpenBLAS runs on one thread too: its threads spin on after a
#: product, and on a loaded machine woke 14 ms late) auto measures MKL on one thread against numpy's BLAS on these
#: small products (m, k, n), apart, and takes the faster (numpy's, 2-5 us against 13-15 on an AMD EPYC)
SMALL_WORK = 1 << 19
NUMPY_WORK = 1 << 18
SMALL_SHAPES = ((64, 64, 64), (64, 64, 10), (64, 10, 64), (10, 64, 64))
CHOICE_ROUNDS = 5
CHOICE_PAUSE_S = 0.15
CHOICE_TIMES = 3
CHOICE_LOCK_S = 30.0
NUMPY_MARGIN = 0.95
CHOICE_FILE = "blas-choice.json"


def choice_key(lib: Any) -> str:
    """What the choice depends on: the processor, its core count and the two libraries' versions."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = _native._cpu_features()
    parts = [model, str(os.cpu_count()), _version(lib), np.__version__, platform.machine(),
             ",".join(f for f in ("avx512f", "avx2", "amx_tile") if f in flags.split())]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _choice(lib: Any) -> dict[str, Any]:
    """auto's choice on this machine: read from the kernel cache, else measured (and written there). One process
    measures at a time (a POSIX lock on a file beside it, which a forked child does not inherit): daemons started
    together (a test suite's workers) each measured under the others' load, could choose differently, and the last
    to write won. A lock that cannot be had (a file system without locks, a holder stopped for CHOICE_LOCK_S) is
    done without."""
    path = _native.cache_dir() / CHOICE_FILE
    try:
        lock = open(path.with_name(f"{CHOICE_FILE}.lock"), "a")  # (held across the measurement)
    except OSError:
        return _measured_or_known(lib, path)  # an unwritable cache: measured here, not kept
    with lock:  # (the lock goes with the file's closing)
        deadline = time.monotonic() + CHOICE_LOCK_S
        while True:
            try:
                fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except (BlockingIOError, PermissionError):  # held by another process: it is measuring
                if time.monotonic() > deadline:
                    log.warning("blas: %s stayed locked for %.0f s; measuring without it", lock.name, CHOICE_LOCK_S)
                    break
                time.sleep(0.05)
            except OSError as e:
                log.debug("blas: no lock on %s (%s); measuring without it", lock.name, e)
                break
        return _measured_or_known(lib, path)


def _measured_or_known(lib: Any, path: Path) -> dict[str, Any]:
    key = choice_key(lib)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    got, times, kept = known.get(key), 0, (float("inf"), float("inf"))
    try:
        if isinstance(got, dict) and got.get("blas") in ("mkl", "numpy"):
            times, kept = int(got.get("times", 1)), (float(got["mkl_us"]), float(got["numpy_us"]))
    except (KeyError, TypeError, ValueError):  # a record damaged or edited by hand: as if there were none
        times = 0
    small_times, small_kept = 0, (float("inf"), float("inf"))
    try:  # (measured apart: a record from before small products were timed has none)
        if times and got.get("small_blas") in ("mkl", "numpy"):  # type: ignore[union-attr]
            small_times = int(got["small_times"])  # type: ignore[index]
            small_kept = (float(got["small_mkl_us"]), float(got["small_numpy_us"]))  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        small_times = 0
    if times >= CHOICE_TIMES and small_times >= CHOICE_TIMES and isinstance(got, dict):
        return got
    mkl_us, numpy_us = measure_products(lib)
    small_mkl_us, small_numpy_us = measure_products(lib, SMALL_SHAPES, one_thread=True)
    if times >= CHOICE_TIMES and isinstance(got, dict):  # the large products' choice stands as kept
        got = dict(got)
    else:
        # the best of this start's figures and the ones kept: a start on a busy machine measures slow
        mkl_us, numpy_us = min(mkl_us, kept[0]), min(numpy_us, kept[1])
        times += 1
        got = {"blas": "numpy" if numpy_us < NUMPY_MARGIN * mkl_us else "mkl", "mkl_us": round(mkl_us, 1),
               "numpy_us": round(numpy_us, 1), "times": times}
        log.info("blas: auto measured MKL %.0f us and numpy's BLAS %.0f us for the MLP step's largest products (the "
                 "best of %d starts' measurements): %s", mkl_us, numpy_us, times, got["blas"])
    small_mkl_us, small_numpy_us = min(small_mkl_us, small_kept[0]), min(small_numpy_us, small_kept[1])
    small_times += 1
    got.update(small_blas="numpy" if small_numpy_us < NUMPY_MARGIN * small_mkl_us else "mkl",
               small_mkl_us=round(small_mkl_us, 1), small_numpy_us=round(small_numpy_us, 1),
               small_times=small_times, measured=time.strftime("%Y-%m-%dT%H:%M:%S"))
    log.info("blas: auto measured MKL %.1f us and numpy's BLAS %.1f us for small products (%d starts): %s",
             small_mkl_us, small_numpy_us, small_times, got["small_blas"])
    known[key] = got
    try:
        tmp = path.with_name(f"{CHOICE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)  # another process reads the whole file or the one before
    except OSError as e:
        log.warning("blas: could not keep auto's choice in %s (%s); it is measured again next time", path, e)
    return got


def measure_products(lib: Any, shapes: tuple[tuple[int, int, int], ...] = CHOICE_SHAPES, one_thread: bool = False
                     ) -> tuple[float, float]:
    """The microseconds of `shapes`'s products, each the best of CHOICE_ROUNDS, on MKL (on one thread: one_thread)
    and on numpy's BLAS."""
    rng = np.random.default_rng(0)
    operands = []
    for m, k, n in shapes:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        operands.append((m, k, n, a, b, np.empty((m, n), np.float32)))

    def on_mkl(m: int, k: int, n: int, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        threads = lib.MKL_Set_Num_Threads_Local(1) if one_thread else 0
        lib.cblas_sgemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n, 0.0,
                        out.ctypes.data, n)
        if one_thread:
            lib.MKL_Set_Num_Threads_Local(threads)

    def on_numpy(m: int, k: int, n: int, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        np.matmul(a, b, out=out)

    best = [[float("inf")] * len(operands) for _ in range(2)]
    for side in (0, 1, 1, 0):
        run = on_mkl if side == 0 else on_numpy
        time.sleep(CHOICE_PAUSE_S)
        for j, args in enumerate(operands):
            run(*args)  # warm
            for _ in range(CHOICE_ROUNDS):
                t0 = time.perf_counter()
                run(*args)
                best[side][j] = min(best[side][j], time.perf_counter() - t0)
    return sum(best[0]) * 1e6, sum(best[1]) * 1e6


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


def _openmp_loaded() -> str | None:
    """The file of the OpenMP runtime already in the process's global scope (libgomp where torch was imported),
    or None."""
    try:
        process = ctypes.CDLL(None)
        symbol = process.omp_get_max_threads
    except (OSError, AttributeError):
        return None
    info = _DlInfo()
    try:
        dladdr = process.dladdr
    except AttributeError:
        return "an unknown library"
    dladdr.argtypes, dladdr.restype = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)], ctypes.c_int
    if not dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return "an unknown library"
    return info.dli_fname.decode(errors="replace")


def omp_dir() -> Path | None:
    """The directory of the OpenMP runtime (libiomp5) that MKL runs on, when MKL is in use: native kernels built
    against it split their loops on MKL's threads."""
    return _lib_dir if mkl() is not None else None


def _version(lib: Any) -> str:
    """MKL's own line about itself ("Intel(R) oneAPI Math Kernel Library Version 2026.2-Product Build ...")."""
    buf = ctypes.create_string_buffer(256)
    lib.MKL_Get_Version_String(buf, len(buf))
    return buf.value.decode(errors="replace").strip()


def short() -> str:
    """`mkl <version>` or `numpy`: what the node record and `deepxctl nodes ls --detail` show."""
    lib = mkl()
    if lib is None:
        return "numpy"
    number = next((w for w in _version(lib).split() if w[:1].isdigit()), "")
    return f"mkl {number.split('-')[0]}".strip()


def describe() -> str:
    """One line for the log and `deepxctl`: which library runs matmul."""
    lib = mkl()
    if lib is None:
        return f"numpy ({_why})" if _why else "numpy"
    return f"mkl ({_version(lib)}, {lib.MKL_Get_Max_Threads()} threads)"


def _layout(a: np.ndarray) -> tuple[int, int] | None:
    """(cblas transpose flag, leading dimension) of the last two axes of `a`, or None where BLAS cannot read them:
    rows contiguous (no transpose) or columns contiguous (a transposed view), in elements, the leading dimension
    within 32 bits. A dimension of one is never stepped over: its stride, whatever it is, is not read."""
    rs, cs = a.strides[-2:]
    item = a.itemsize
    r, c = a.shape[-2:]
    if (cs == item or c == 1) and (r == 1 or (rs % item == 0 and rs >= max(c, 1) * item)):
        ld = max(c, 1) if r == 1 else rs // item
        return (_NO_TRANS, ld) if ld <= _INT_MAX else None
    if (rs == item or r == 1) and (c == 1 or (cs % item == 0 and cs >= max(r, 1) * item)):
        ld = max(r, 1) if c == 1 else cs // item
        return (_TRANS, ld) if ld <= _INT_MAX else None
    return None


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_CHAR = ctypes.c_char
_addressof = ctypes.addressof


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """out = a @ b through MKL (float32 and float64, 2-D, or stacks of matrices of one batch shape, a 2-D operand
    repeated over the other's stack); False where the caller must use numpy (no MKL, another dtype or layout, an
    output that overlaps an operand, sizes beyond 32 bits)."""
    lib = _mkl if _tried else mkl()
    dt = out.dtype
    if lib is None or (dt is not _F32 and dt is not _F64) or a.dtype is not dt or b.dtype is not dt:
        return False
    nd = out.ndim
    if a.ndim < 2 or b.ndim < 2 or nd != max(a.ndim, b.ndim):
        return False
    m, k = a.shape[-2:]
    n = b.shape[-1]
    if b.shape[-2] != k or out.shape[-2:] != (m, n) or not k or max(m, n, k) > _INT_MAX:
        return False
    small = _small and nd == 2 and m * n * k <= SMALL_WORK
    if small and _small_numpy and m * n * k <= NUMPY_WORK:
        return False  # numpy's BLAS makes it faster here (auto's measurement)
    try:
        o = _addressof(_CHAR.from_buffer(out))  # type: ignore[arg-type]  # C-contiguous and writable
    except (TypeError, ValueError):
        return False
    size = out.size
    if not size or size > _INT_MAX:
        return False
    la, lb = _layout(a), _layout(b)
    if la is None or lb is None or np.may_share_memory(out, a) or np.may_share_memory(out, b):
        return False
    single = dt is _F32
    if small:
        fn = lib.cblas_sgemm if single else lib.cblas_dgemm
        threads = lib.MKL_Set_Num_Threads_Local(1)  # (this thread's, till set back)
        fn(_ROW_MAJOR, la[0], lb[0], m, n, k, 1.0, _address(a), la[1], _address(b), lb[1], 0.0, o, n)
        lib.MKL_Set_Num_Threads_Local(threads)
        return True
    if nd == 2:
        if (m <= _SMALL or n <= _SMALL or k <= _SMALL) and _native.small_product(
                a, b, out, la[0] == _TRANS, la[1], lb[0] == _TRANS, lb[1]):
            return True  # one dimension of a few: the native loops (native.SKINNY)
        fn = lib.cblas_sgemm if single else lib.cblas_dgemm
        if NARROW[0] <= n <= NARROW[1] and m >= NARROW_ROWS and k >= NARROW_DEPTH:
            # a few columns, deep (a classifier's logits): the transposed product, then its transpose into out
            t = np.empty((n, m), dt)
            fn(_ROW_MAJOR, _FLIP[lb[0]], _FLIP[la[0]], n, m, k, 1.0, _address(b), lb[1], _address(a), la[1], 0.0,
               _address(t), m)
            out[...] = t.T
            return True
        fn(_ROW_MAJOR, la[0], lb[0], m, n, k, 1.0, _address(a), la[1], _address(b), lb[1], 0.0, o, n)
        return True
    batch = out.shape[:-2]
    count = size // (m * n)
    sa, sb = _stride(a, batch), _stride(b, batch)
    if sa is None or sb is None:
        return False
    if sb == 0 and la[0] == _NO_TRANS and sa == m * la[1] and count * m <= _INT_MAX:
        # a stack of row-major matrices, one after another, times one matrix: one product of all their rows
        fn = lib.cblas_sgemm if single else lib.cblas_dgemm
        fn(_ROW_MAJOR, _NO_TRANS, lb[0], count * m, n, k, 1.0, _address(a), la[1], _address(b), lb[1], 0.0, o, n)
        return True
    fn = lib.cblas_sgemm_batch_strided if single else lib.cblas_dgemm_batch_strided
    fn(_ROW_MAJOR, la[0], lb[0], m, n, k, 1.0, a.ctypes.data, la[1], sa, b.ctypes.data, lb[1], sb, 0.0, o, n, m * n,
       count)
    return True


def _stride(x: np.ndarray, batch: tuple[int, ...]) -> int | None:
    """The step, in elements, from one matrix of x to the next over the output's batch dims (flattened): 0 for a
    2-D operand (repeated); else x's batch dims must be the output's and its matrices evenly spaced."""
    if x.ndim == 2:
        return 0
    if x.shape[:-2] != batch:
        return None
    item = x.itemsize
    step: int | None = None
    span = 1
    for size, st in zip(reversed(batch), reversed(x.strides[:-2])):
        if size != 1:
            if st < 0 or st % item:
                return None
            if step is None:
                if (st // item) % span:
                    return None
                step = st // item // span
            elif st // item != step * span:
                return None
        span *= size
    if step is None:  # every batch dim is one: a single matrix
        return 0
    return step if step <= _INT_MAX else None
