"""Native CPU kernels: small C loops, compiled at run time by the machine's C compiler and called through ctypes.

numpy runs one whole-array pass per ufunc. An update such as momentum SGD (`buf = buf*m + g; p -= lr*buf`) then
reads and writes its tensors several times over, and `maximum(x, 0)` on float32 takes a NaN-checking loop at a
fraction of memory speed. The loops here do each in one pass, with the same operations in the same order as the
numpy code they replace (no fast-math, no fused multiply-add, no constants for the compiler to fold), so their
results are the same bits. One exception: where two NaNs meet in an addition or a product, the result is one of
them, and which (its sign and payload) may differ from numpy's, as the compiler may put the operands of a
commutative operation either way round (found in review; every result that is not NaN, and whether it is NaN, is
numpy's).

What is here:

- a fixed library (`CORE`): relu, the sgd, adam and adamw updates, and erf, gelu and gelu's gradient (`SPECIAL`:
  vectorised with their own exp, not numpy's bits), for float32 and float64;
- fused expressions (the `fused` op) without transcendental calls, generated per structure (the expression with
  its numbers lifted out and passed in at run time, the compute dtype, and how each input is laid out: the output's
  shape, one element, the output's trailing dimensions as a bias is, or its leading ones as a column). exp, log,
  tanh, sin, cos, tan and `**` stay on numpy's SIMD loops: libm's scalar calls are no faster (tanh is 7x slower)
  and do not give numpy's bits (docs/compiler.md has the measurement).

Each source is compiled once per machine into a cache directory (`DEEPX_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/deepx/kernels`, else `~/.cache/deepx/kernels`), keyed by the source, the flags, the compiler and
the CPU's features, and loaded from there afterwards (a directory of this user's that nobody else may write). An
expression is compiled only once its structure has run HOT times, so that one-off expressions never wait for the
compiler, and then on a thread of its own while numpy goes on running it (`set_background`,
`DEEPX_NATIVE_BACKGROUND=0` to compile on the spot). Where no compiler is found, or one fails, or
`DEEPX_NATIVE_KERNELS=0` is set (the config's `native_kernels = 0`), every kernel runs on numpy as before; a
failure is logged once.

The callers check dtype, layout, sizes and overlap before calling: a C loop is handed only C-contiguous arrays of
its dtype, of the sizes it is told, whose outputs are writable and either one of its inputs or overlap none of
them. ctypes
releases the GIL during a call, so large arrays are split across threads.
"""

from __future__ import annotations

import ast
import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deepx_core.cache import Cache, memoize
from deepxd.kernels.cpu._util import address as _address

log = logging.getLogger(__name__)

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
CTYPE = {F32: "float", F64: "double"}
SUFFIX = {F32: "f32", F64: "f64"}

#: an expression is compiled after it has run this many times on numpy
HOT = 3
MAX_THREADS = max(1, min(8, os.cpu_count() or 1))  # the kernels' thread pool (fused._threads) and its pieces
#: relu runs on numpy below this many elements, where a call through ctypes costs more than the loop saves
RELU_MIN = 1 << 15
#: fused expressions run on numpy's tape below this many elements, where the tape costs less than the call; not
#: those with column sums (fusedcolsum: a ReLU's gradient and its bias's, 64 x 128, 25-30 us on numpy in the digits
#: step)
FUSED_MIN = 1 << 15
#: with a row or column input (numpy's broadcasting iterator, slow on small tensors), from this many elements up
BROADCAST_MIN = 256
#: optimizer updates run on numpy below this many elements
UPDATE_MIN = 1 << 15
#: ...except an sgd step of a program run again and again (sgd_call), which runs natively from this many: its checks
#: are made once, and inside the MLP step numpy's three passes over a cold bias of 512 took 11-26 us, the loop 2-3;
#: on a few dozen elements (a tiny MLP's) numpy's passes cost less than the call
SGD_CALL_MIN = 256
#: ...and an adam step of such a program (adam_call) from this many: numpy's ten passes and temporaries cost more than
#: the call on any tensor but a handful of elements (the digits MLP's bias of 10: 7.6 us on numpy, the loop about 2)
ADAM_CALL_MIN = 8
#: sums over leading axes (colsum) run on numpy below this many elements; a bias gradient of 256x10 (2560 values)
#: took 17 us in C against 28-30 us on numpy inside the MLP step, and of 64x10 (the digits MLP's) 3-4 against 15
COLSUM_MIN = 1 << 8
#: elements per thread below which a kernel runs on the calling thread alone (Python's thread pool, without MKL)
THREAD_MIN = 1 << 18
#: ...for erf and gelu, which compute far longer per element than they take to read (about 0.5 ns a float32)
SPECIAL_THREAD_MIN = 1 << 16
#: with MKL's OpenMP runtime (blas.py), elements from which a loop is split across its threads: the worker a GEMM
#: leaves spinning takes its half at once (docs/decisions/0016-mkl-by-measurement.md)
OMP_MIN = 1 << 15
# no -ffast-math and no contraction into fused multiply-adds: IEEE results, as numpy's. -fno-math-errno and
# -fno-trapping-math change no value (errno and floating-point exception flags only); they let selects vectorize.
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
         "-fno-strict-aliasing")

_lock = threading.Lock()
_enabled = os.environ.get("DEEPX_NATIVE_KERNELS", "1").strip() != "0"  # as the config reads it: 1 or 0
_compiler: str | bool | None = False  # False: not looked for yet; None: none found
_march: bool | None = None  # whether -march=native works here
_failed: set[str] = set()
_libs: dict[str, Any] = {}
# a fused expression that has become HOT is compiled on a thread of its own while the op worker goes on running it
# on numpy, so that no program waits for the compiler (DEEPX_NATIVE_BACKGROUND=0, set_background(False): compiled on
# the spot, before the call that made it HOT returns, which the tests rely on)
_background = os.environ.get("DEEPX_NATIVE_BACKGROUND", "1").strip() != "0"
_building: dict[Any, threading.Thread] = {}
_core_thread: threading.Thread | None = None  # the fixed library's background build, while it runs
_split_on = True  # set_split
_omp_failed = False  # an OpenMP build failed here: later libraries are built without it
_building_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's other threads: locks they held, and builds they ran, start afresh."""
    global _lock, _building_lock, _core_thread
    _lock, _building_lock = threading.Lock(), threading.Lock()
    _building.clear()
    _core_thread = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def set_enabled(on: bool) -> bool:
    """Turn the native kernels on or off for this process (the config's `native_kernels`); returns the old state."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


def set_background(on: bool) -> bool:
    """Compile fused expressions on a background thread (True, the default) or on the spot; returns the old
    setting."""
    global _background
    previous, _background = _background, bool(on)
    return previous


def wait_builds(timeout: float | None = None) -> bool:
    """Wait for the fixed library and the fused expressions being compiled in the background; whether none is
    left."""
    with _building_lock:
        threads = list(_building.values()) + ([_core_thread] if _core_thread is not None else [])
    for t in threads:
        t.join(timeout)
    with _building_lock:
        return not _building and (_core_thread is None or not _core_thread.is_alive())


def enabled() -> bool:
    return _enabled


def compiler() -> str | None:
    """The C compiler: $CC, else cc, gcc or clang on the PATH; None where there is none."""
    global _compiler
    if _compiler is False:
        cc = os.environ.get("CC", "").strip()
        found = shutil.which(cc) if cc else None
        for name in ("cc", "gcc", "clang"):
            if found:
                break
            found = shutil.which(name)
        _compiler = found
        if found is None:
            log.info("native kernels: no C compiler (cc, gcc, clang) found; the CPU kernels run on numpy")
    return _compiler if isinstance(_compiler, str) else None


def available() -> bool:
    """Whether native kernels may be used: enabled, and a compiler exists."""
    return _enabled and compiler() is not None


def cache_dir() -> Path:
    """Where compiled kernels are kept, made on first use (mode 0700). A directory this process did not make must
    belong to its user and be writable by nobody else: a library found there is loaded and run. Failing that, a
    private temporary directory for this process."""
    env = os.environ.get("DEEPX_KERNEL_CACHE")
    if env:
        base = Path(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "deepx" / "kernels"
    for d in (base, Path(tempfile.gettempdir()) / f"deepx-kernels-{_uid()}"):
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            if _private(d):
                return d
            log.warning("native kernels: not using %s (another user owns it, or others may write it)", d)
        except OSError:
            pass
    global _scratch
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="deepx-kernels-"))
    return _scratch


_scratch: Path | None = None


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def _private(d: Path) -> bool:
    st = d.stat()
    return st.st_uid == _uid() and not st.st_mode & 0o022 and os.access(d, os.W_OK)


@memoize("kernels.cpu.native._cpu_features", 64)
def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@memoize("kernels.cpu.native._version", 64)
def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, errors="replace", timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _flags(cc: str) -> tuple[str, ...]:
    """FLAGS, with -march=native where the compiler takes it (the cache key carries the CPU's features)."""
    global _march
    if _march is None:
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "probe.c"
            src.write_text("int deepx_probe(void) { return 1; }\n")
            try:
                r = subprocess.run([cc, *FLAGS, "-march=native", str(src), "-o", str(Path(d) / "probe.so")],
                                   capture_output=True, timeout=60)
                _march = r.returncode == 0
            except (OSError, subprocess.SubprocessError):
                _march = False
    return (*FLAGS, "-march=native") if _march else FLAGS


def set_split(on: bool) -> None:
    """Whether kernels built with OpenMP split their loops (blas.set_mode: not under numpy's BLAS, whose idle
    threads would spin against them); they run their serial loops otherwise."""
    global _split_on
    _split_on = bool(on)


def split() -> bool:
    """Whether loops built with OpenMP split across its threads now (set_split)."""
    return _split_on


def _omp() -> Path | None:
    """Where MKL's OpenMP runtime lies when native kernels split their loops on its threads (MKL in use), else
    None: then no kernel is built with OpenMP (a second runtime's idle threads would spin against OpenBLAS's)."""
    from deepxd.kernels.cpu import blas

    return None if _omp_failed else blas.omp_dir()


def load(source: str, openmp: bool = False) -> Any:
    """The library compiled from `source` (a ctypes.CDLL), compiled on first use and cached; None when it cannot be
    had (no compiler, or the compiler failed: logged once per source). openmp: the source has OpenMP pragmas, built
    against MKL's OpenMP runtime (None where MKL is not in use)."""
    if not available():
        return None
    omp = _omp() if openmp else None
    if openmp and omp is None:
        return None
    lib = _libs.get(source)
    if lib is not None:
        return lib
    with _lock:
        lib = _libs.get(source)
        if lib is not None or source in _failed:
            return lib
        cc = compiler()
        assert cc is not None
        flags = _flags(cc)
        link = ("-L", str(omp), "-liomp5", f"-Wl,-rpath,{omp}") if omp is not None else ()
        key = hashlib.sha256("\0".join([source, " ".join(flags), " ".join(link), _version(cc), _cpu_features(),
                                        platform.machine()]).encode()).hexdigest()[:32]
        target = cache_dir() / f"deepx_{key}.so"
        try:
            if target.exists():
                try:
                    lib = ctypes.CDLL(str(target))
                except OSError as e:  # a damaged file (a full disk, say): built again below
                    log.warning("native kernels: %s does not load (%s); compiling it again", target, e)
                    target.unlink(missing_ok=True)
            if lib is None:
                _compile(cc, flags, source, target, link)
                lib = ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError) as e:
            _failed.add(source)
            if link:  # the caller builds it again without OpenMP, as every library after it
                global _omp_failed
                _omp_failed = True
                log.warning("native kernels: building with MKL's OpenMP runtime failed (%s); kernels run on one "
                            "thread", e)
            else:
                log.warning("native kernels: compiling a kernel failed (%s); it runs on numpy", e)
            return None
        _libs[source] = lib
        return lib


def _compile(cc: str, flags: Sequence[str], source: str, target: Path, link: Sequence[str] = ()) -> None:
    """Compile `source` into the shared library `target`. link: the OpenMP runtime to link (MKL's libiomp5): the
    source is then compiled with -fopenmp and linked apart, so that the compiler adds no runtime of its own (gcc's
    libgomp; libiomp5 answers gcc's GOMP_ calls and clang's __kmpc_ ones)."""
    with tempfile.TemporaryDirectory(dir=target.parent) as d:
        src = Path(d) / "kernel.c"
        src.write_text(source)
        built = Path(d) / target.name
        if link:
            obj = Path(d) / "kernel.o"
            steps = [[cc, *flags, "-fopenmp", "-c", str(src), "-o", str(obj)],
                     [cc, *flags, str(obj), "-o", str(built), *link, "-lm"]]
        else:
            steps = [[cc, *flags, str(src), "-o", str(built), "-lm"]]
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=120)
            if r.returncode != 0:
                raise OSError(f"{cc} exited with {r.returncode}: {r.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: another process sees the whole library or none


# ------------------------------------------------------------------ the fixed library

_IVDEP = """#if defined(__clang__)
#define IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define IVDEP _Pragma("GCC ivdep")
#else
#define IVDEP
#endif"""

CORE = r"""
#include <math.h>
#include <string.h>
/* An output is one of the inputs or overlaps none (the callers check): each loop reads element i of every input
   before it writes element i of any output, so no store changes a later load, which IVDEP tells the compiler (it
   then vectorizes without checking overlaps at run time). Writing straight to the outputs is 10-25% faster than
   computing blocks into locals and copying them out (docs/decisions/0014-native-cpu-kernels.md). */
""" + _IVDEP + r"""
#define RELU(T, S) \
void relu_##S(long n, const T *x, T *o) { \
    for (long i = 0; i < n; i++) { T v = x[i]; o[i] = v != v ? v : (v > 0 ? v : (T)0); } \
}
/* p - lr*g after optional weight decay (g + wd*p) and momentum (buf*m + keep*g, or g on the first step; nesterov:
   g + m*buf), the order of deepxd/kernels/cpu/optim.py's numpy code */
#define SGD(T, S) \
void sgd_##S(long n, const T *p, const T *g, const T *b, T *po, T *bo, T lr, T m, T keep, T wd, int decay, \
             int momentum, int first, int nesterov, int damp) { \
    if (momentum && !first && !decay && !nesterov && !damp) { \
        IVDEP for (long i = 0; i < n; i++) { \
            T pi = p[i], gi = g[i], bi = b[i] * m + gi; \
            bo[i] = bi; po[i] = pi - lr * bi; \
        } \
        return; \
    } \
    IVDEP for (long i = 0; i < n; i++) { \
        T pi = p[i], gi = g[i], bi = momentum && !first ? b[i] : (T)0; \
        if (decay) gi = gi + wd * pi; \
        if (momentum) { \
            bi = first ? gi : (damp ? bi * m + keep * gi : bi * m + gi); \
            bo[i] = bi; \
            gi = nesterov ? gi + m * bi : bi; \
        } \
        po[i] = pi - lr * gi; \
    } \
}
/* adam (decoupled 0) and adamw (1), as optim.py's _adam: m*b1 + (1-b1)*g, v*b2 + (1-b2)*(g*g),
   p - step * m / (sqrt(v) / bc2s + eps) */
#define ADAM(T, S, SQRT) \
void adam_##S(long n, const T *p, const T *g, const T *m, const T *v, T *po, T *mo, T *vo, T b1, T c1, T b2, \
              T c2, T eps, T wd, T shrink, T step, T bc2s, int decay, int decoupled) { \
    IVDEP for (long i = 0; i < n; i++) { \
        T pi = p[i], gi = g[i], mi = m[i], vi = v[i]; \
        if (decay) { if (decoupled) pi = pi * shrink; else gi = gi + wd * pi; } \
        mi = mi * b1 + c1 * gi; \
        vi = vi * b2 + c2 * (gi * gi); \
        T d = SQRT(vi) / bc2s + eps; \
        mo[i] = mi; vo[i] = vi; \
        po[i] = pi - step * mi / d; \
    } \
}
/* numpy's pairwise summation of n contiguous values (what np.sum does along a contiguous axis), in its order */
#define PWSUM(T, S) \
static T pwsum_##S(const T *a, long n) { \
    if (n < 8) { T res = 0; for (long i = 0; i < n; i++) res += a[i]; return res; } \
    if (n <= 128) { \
        T r[8]; long i; \
        for (int k = 0; k < 8; k++) r[k] = a[k]; \
        for (i = 8; i < n - (n % 8); i += 8) for (int k = 0; k < 8; k++) r[k] += a[i + k]; \
        T res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7])); \
        for (; i < n; i++) res += a[i]; \
        return res; \
    } \
    long n2 = n / 2; n2 -= n2 % 8; \
    return pwsum_##S(a, n2) + pwsum_##S(a + n2, n - n2); \
}
/* rows of x (n rows of c) minus their max (a row whose max is not finite: minus 0), as nn._shifted */
#define ROWSHIFT(T, S) \
void rowshift_##S(long n, long c, const T *x, T *o) { \
    for (long r = 0; r < n; r++) { \
        const T *xr = x + r * c; T *orow = o + r * c; \
        T m = xr[0]; \
        for (long j = 1; j < c; j++) { T v = xr[j]; if (v > m || v != v) m = v; if (m != m) break; } \
        if (!isfinite(m)) m = 0; \
        for (long j = 0; j < c; j++) orow[j] = xr[j] - m; \
    } \
}
/* crossentropy's gradient from e = exp(shifted logits), in place: ((e / rowsum - onehot) * keep) * scale, with
   scale = g / (kept rows) (mode 0, mean), g (1, sum) or g[r] (2, none), as nn.crossentropygrad's numpy steps */
#define CEGRAD(T, S) \
void cegrad_##S(long n, long c, T *e, const long long *labels, const T *g, long long ignore, int mode) { \
    T scale = g[0]; \
    if (mode == 0) { \
        long kept = 0; \
        for (long r = 0; r < n; r++) kept += labels[r] != ignore; \
        if (!kept) { memset(e, 0, n * c * sizeof(T)); return; } /* every label ignored: zeros, as torch's */ \
        scale = g[0] / (T)kept; \
    } \
    for (long r = 0; r < n; r++) { \
        T *er = e + r * c; \
        T s = pwsum_##S(er, c); \
        long long lab = labels[r]; \
        T keep = lab != ignore ? (T)1 : (T)0; \
        T sc = mode == 2 ? g[r] : scale; \
        for (long j = 0; j < c; j++) { \
            T v = er[j] / s; \
            v = v - (lab == j ? (T)1 : (T)0); \
            er[j] = (v * keep) * sc; \
        } \
    } \
}
/* crossentropy's rows: rs[r] = the sum of e's row (numpy's pairwise order), ps[r] = s[r, labels[r]] */
#define CEROWS(T, S) \
void cerows_##S(long n, long c, const T *e, const T *s, const long long *labels, T *rs, T *ps) { \
    for (long r = 0; r < n; r++) { rs[r] = pwsum_##S(e + r * c, c); ps[r] = s[r * c + labels[r]]; } \
}
/* crossentropy's usual batch: 0 where every label is in [0, c) and `ignore` is outside their range, with s = x's
   rows shifted (as rowshift) and ps[r] = s[r, labels[r]]; else 1, nothing written */
#define CEPREP(T, S) \
int ceprep_##S(long n, long c, const T *x, const long long *labels, long long ignore, T *s, T *ps) { \
    long long lo = labels[0], hi = labels[0]; \
    for (long r = 1; r < n; r++) { long long v = labels[r]; if (v < lo) lo = v; if (v > hi) hi = v; } \
    if (lo < 0 || hi >= c || (lo <= ignore && ignore <= hi)) return 1; \
    rowshift_##S(n, c, x, s); \
    for (long r = 0; r < n; r++) ps[r] = s[r * c + labels[r]]; \
    return 0; \
}
/* rs[r] = the sum of e's row r (numpy's pairwise order) */
#define CESUMS(T, S) \
void cesums_##S(long n, long c, const T *e, T *rs) { for (long r = 0; r < n; r++) rs[r] = pwsum_##S(e + r * c, c); }
/* out = the mean (mode 0) or the sum (1) of rs - ps (written into rs), as nn._reduce: numpy's pairwise sum in T, the
   mean a division in double (numpy's T / intp) rounded to T */
#define CEREDUCE(T, S) \
void cereduce_##S(long n, T *rs, const T *ps, int mode, T *out) { \
    for (long r = 0; r < n; r++) rs[r] = rs[r] - ps[r]; \
    T total = (T)0 + pwsum_##S(rs, n); /* numpy's reduction starts from +0 (so -0 values sum to +0) */ \
    out[0] = mode == 0 ? (T)((double)total / (double)n) : total; \
}
/* out[j] = the sum of a[r, j] over the rows, one row after another from +0: numpy's order for a C-contiguous array
   summed over its leading axes when the rest has two elements or more (with one, numpy sums pairwise) */
#define COLSUM(T, S) \
void colsum_##S(long rows, long cols, const T *a, T *out) { \
    for (long j = 0; j < cols; j++) out[j] = (T)0 + a[j]; /* from +0, as numpy's: -0 values sum to +0 */ \
    for (long r = 1; r < rows; r++) { \
        const T *ar = a + r * cols; \
        IVDEP for (long j = 0; j < cols; j++) out[j] = out[j] + ar[j]; \
    } \
}
RELU(float, f32) RELU(double, f64)
SGD(float, f32) SGD(double, f64)
ADAM(float, f32, sqrtf) ADAM(double, f64, sqrt)
PWSUM(float, f32) PWSUM(double, f64)
ROWSHIFT(float, f32) ROWSHIFT(double, f64)
CEGRAD(float, f32) CEGRAD(double, f64)
CEROWS(float, f32) CEROWS(double, f64)
CEPREP(float, f32) CEPREP(double, f64)
CESUMS(float, f32) CESUMS(double, f64)
CEREDUCE(float, f32) CEREDUCE(double, f64)
COLSUM(float, f32) COLSUM(double, f64)
""" + r"""
/* erf, gelu (exact and tanh forms) and gelu's gradient (docs/decisions/0033-round-trips-and-gelu.md).

   float32 evaluates in float32 (each lane of a vector every form, then a select: the loops vectorize), with
   polynomials fitted for these kernels: erf(x)/x in x^2 below 0.9, and erfc(y) = exp(-y^2) t G(t), t = 1/(1 + y/2),
   G fitted over y in [0, 10] to 2e-8 relative. float64 evaluates W. J. Cody's rational approximations, as the numpy
   code of deepxd/kernels/cpu/nn.py does (the tail form, y > 4, only in blocks that hold such a value). Both take
   exp(-y^2) with y^2 split exactly into its rounded value and the rounding's error (a fused multiply-add), so that
   gelu's negative tail keeps its relative precision, and both write gelu's tail as (x e) h, which stays normal on
   the way to a normal result. */
/* DX_SQLO(x, h): x*x - h exactly, h = x*x rounded (a fused multiply-add, else Dekker's split) */
#ifdef FP_FAST_FMAF
#define DX_FMAF(a, b, c) fmaf(a, b, c)
#define DX_SQLOF(x, h) fmaf(x, x, -(h))
#else
#define DX_FMAF(a, b, c) ((a) * (b) + (c))
static inline float dx_sqlof(float x, float h) {
    float c = 4097.0f * x, hi = c - (c - x), lo = x - hi;
    return ((hi * hi - h) + 2.0f * hi * lo) + lo * lo;
}
#define DX_SQLOF(x, h) dx_sqlof(x, h)
#endif
#ifdef FP_FAST_FMA
#define DX_FMA(a, b, c) fma(a, b, c)
#define DX_SQLO(x, h) fma(x, x, -(h))
#else
#define DX_FMA(a, b, c) ((a) * (b) + (c))
static inline double dx_sqlo(double x, double h) {
    double c = 134217729.0 * x, hi = c - (c - x), lo = x - hi;
    return ((hi * hi - h) + 2.0 * hi * lo) + lo * lo;
}
#define DX_SQLO(x, h) dx_sqlo(x, h)
#endif
#define DX_SQRT1_2 0.70710678118654752440
#define DX_INV_SQRT_2PI 0.39894228040143267794
#define DX_TANH_K 0.79788456080286535588
/* exp(x + y) 2^24 for x <= 0 and a tiny y (a correction to x), about 1 ulp, scaled so that it stays normal down to
   exp(x) = 2^-149; below -103 some value (the callers select 0), and a nan gives some value (their other terms
   carry the nan) */
static inline float dx_expneg24f(float x, float y) {
    float km = DX_FMAF(x, 1.44269504088896341f, 12582912.0f), kf = km - 12582912.0f;  /* k = rint(x/ln 2) */
    float r = DX_FMAF(kf, -0.693359375f, x);
    r = DX_FMAF(kf, 2.12194440e-4f, r) + y;
    float p = 1.3824834455940576e-03f;
    p = DX_FMAF(p, r, 8.371556263811612e-03f); p = DX_FMAF(p, r, 4.166823520386102e-02f);
    p = DX_FMAF(p, r, 1.666646063088236e-01f); p = DX_FMAF(p, r, 4.9999993061015097e-01f);
    p = DX_FMAF(p, r, 1.0000000269215064f); p = DX_FMAF(p, r, 1.0000000004124192f);
    unsigned kb, pb;
    memcpy(&kb, &km, 4);
    memcpy(&pb, &p, 4);
    pb += (kb << 23) + (24u << 23);  /* k sits in km's low bits: p 2^(k + 24) */
    float e;
    memcpy(&e, &pb, 4);
    return e;
}
/* exp(-c a^2) 2^24 for a >= 0 (0 where exp(-c a^2) < 2^-149, a = inf too); where `exact`, of a^2 = h + l exactly
   (h rounded, l its rounding error): exp(-c h - c l) */
static inline float dx_gauss24f(float a, float c, int exact) {
    float h = a * a, x = -(h * c);
    float e = dx_expneg24f(x, exact ? -c * DX_SQLOF(a, h) : 0.0f);
    return x < -103.0f ? 0.0f : e;
}
#define DX_2M24 5.9604644775390625e-08f
#define DX_2M25 2.98023223876953125e-08f
/* erf(x)/x for |x| < 0.9, in x^2 */
static inline float dx_erfsmallf(float s) {
    float p = 8.553019515534142e-05f;
    p = DX_FMAF(p, s, -8.1859284176890082e-04f); p = DX_FMAF(p, s, 5.2048708033637118e-03f);
    p = DX_FMAF(p, s, -2.6860979209723457e-02f); p = DX_FMAF(p, s, 1.1283725399975141e-01f);
    p = DX_FMAF(p, s, -3.7612635900461006e-01f); p = DX_FMAF(p, s, 1.1283791669548651f);
    return p;
}
/* erfc(y) exp(y^2) = t G(t), t = 1/(1 + w), w = y/2 */
static inline float dx_erfcxf(float w) {
    float t = 1.0f / (1.0f + w), u = DX_FMAF(t, 2.4f, -1.4f);
    float g = 5.1232533156e-06f;
    g = DX_FMAF(g, u, -5.3197340550e-05f); g = DX_FMAF(g, u, 8.1653802275e-06f);
    g = DX_FMAF(g, u, 5.8522005695e-04f); g = DX_FMAF(g, u, -6.2225046853e-04f);
    g = DX_FMAF(g, u, -6.1503756615e-03f); g = DX_FMAF(g, u, 5.9635313310e-03f);
    g = DX_FMAF(g, u, 1.0202933556e-01f); g = DX_FMAF(g, u, 3.2622244817e-01f);
    g = DX_FMAF(g, u, 5.7201198407e-01f);
    return t * g;
}
/* erf: 1 - erfc needs erfc only to an absolute precision there, so exp(-x^2) of the rounded square */
void erf_f32(long n, const float *x, float *o) {
    IVDEP for (long i = 0; i < n; i++) {
        float v = x[i], a = fabsf(v);
        float small = v * dx_erfsmallf(v * v);
        float big = copysignf(1.0f - (dx_gauss24f(a, 1.0f, 0) * DX_2M24) * dx_erfcxf(0.5f * a), v);
        o[i] = a < 0.9f ? small : big;
    }
}
/* gelu(x) = x Phi(x), Phi(x) = erfc(-x/sqrt 2)/2: e h below 0, 1 - e h above, with e = exp(-x^2/2) and
   h = erfc(|x|/sqrt 2)/(2e) */
void gelu_f32(long n, const float *x, float *o) {
    IVDEP for (long i = 0; i < n; i++) {
        float v = x[i], a = fabsf(v);
        float E = dx_gauss24f(a, 0.5f, 1), t = dx_erfcxf((float)(0.5 * DX_SQRT1_2) * a);  /* e h = E t 2^-25 */
        o[i] = v > 0 ? v * (1.0f - (E * DX_2M25) * t) : ((v * E) * t) * DX_2M25;  /* (inf: inf) */
    }
}
/* d gelu = g (Phi(x) + x phi(x)), phi(x) = e/sqrt(2 pi): below 0 as e (h + x/sqrt(2 pi)) */
void gelugrad_f32(long n, const float *x, const float *g, float *o) {
    IVDEP for (long i = 0; i < n; i++) {
        float v = x[i], a = fabsf(v), q = v * (float)DX_INV_SQRT_2PI;
        float E = dx_gauss24f(a, 0.5f, 1), e = E * DX_2M24, h = 0.5f * dx_erfcxf((float)(0.5 * DX_SQRT1_2) * a);
        o[i] = g[i] * (v > 0 ? DX_FMAF(q, e, DX_FMAF(-e, h, 1.0f)) : (E * (h + q)) * DX_2M24);
    }
}
/* the tanh form: x (1 + tanh(u))/2 = x s, s = 1/(1 + exp(-2u)) = 1/(1 + w) above 0 and w/(1 + w) below, with
   w = exp(-2|u|) <= 1: no cancellation, no overflow; u = sqrt(2/pi) (x + 0.044715 x^3) */
#define DX_TANH_PARTS(v2) \
    float u = (float)DX_TANH_K * DX_FMAF(0.044715f * v, v2, v); \
    float x2 = -2.0f * fabsf(u), W = x2 < -103.0f ? 0.0f : dx_expneg24f(x2, 0.0f), w = W * DX_2M24; \
    float d = 1.0f / (1.0f + w);
void gelutanh_f32(long n, const float *x, float *o) {
    IVDEP for (long i = 0; i < n; i++) {
        float v = x[i];
        DX_TANH_PARTS(v * v)
        o[i] = u >= 0 ? v * d : ((v * W) * d) * DX_2M24;
    }
}
/* its gradient: s + 2 x u' s (1 - s), u' = sqrt(2/pi) (1 + 3 0.044715 x^2), s (1 - s) = w d^2: d (1 + 2 x u' w d)
   above 0, w d (1 + 2 x u' d) below (w scaled: no subnormal on the way); the term with u' 0 where w is (no inf * 0;
   a nan stays one) */
void gelutanhgrad_f32(long n, const float *x, const float *g, float *o) {
    IVDEP for (long i = 0; i < n; i++) {
        float v = x[i], v2 = v * v;
        DX_TANH_PARTS(v2)
        float vdu = (2.0f * v) * ((float)DX_TANH_K * DX_FMAF(3.0f * 0.044715f, v2, 1.0f));
        float above = d * DX_FMAF(vdu, w == 0.0f ? 0.0f * v : w * d, 1.0f);
        float below = ((W * d) * DX_FMAF(vdu, W == 0.0f ? 0.0f * v : d, 1.0f)) * DX_2M24;
        o[i] = g[i] * (u >= 0 ? above : below);
    }
}
/* float64: exp(x) to about 1 ulp (nan: nan), 2^k as two factors */
static inline double dx_exp(double x) {
    x = x < -746.0 ? -746.0 : x;
    x = x > 710.0 ? 710.0 : x;
    double kf = rint(x * 1.44269504088896338700);
    double r = DX_FMA(kf, -6.93147180369123816490e-01, x);
    r = DX_FMA(kf, -1.90821492927058770002e-10, r);
    double p = 1.0 / 6227020800.0;
    p = DX_FMA(p, r, 1.0 / 479001600.0); p = DX_FMA(p, r, 1.0 / 39916800.0); p = DX_FMA(p, r, 1.0 / 3628800.0);
    p = DX_FMA(p, r, 1.0 / 362880.0); p = DX_FMA(p, r, 1.0 / 40320.0); p = DX_FMA(p, r, 1.0 / 5040.0);
    p = DX_FMA(p, r, 1.0 / 720.0); p = DX_FMA(p, r, 1.0 / 120.0); p = DX_FMA(p, r, 1.0 / 24.0);
    p = DX_FMA(p, r, 1.0 / 6.0); p = DX_FMA(p, r, 0.5); p = DX_FMA(p, r, 1.0); p = DX_FMA(p, r, 1.0);
    int k = (int)kf, k1 = k / 2, k2 = k - k1;
    unsigned long long b1 = (unsigned long long)(k1 + 1023) << 52, b2 = (unsigned long long)(k2 + 1023) << 52;
    double s1, s2;
    memcpy(&s1, &b1, 8);
    memcpy(&s2, &b2, 8);
    return p * s1 * s2;
}
/* exp(-c a^2), a >= 0 (inf: 0) */
static inline double dx_gauss(double a, double c) {
    a = a > 64.0 ? 64.0 : a;
    double h = a * a, l = DX_SQLO(a, h);
    return dx_exp(-(h * c)) * DX_FMA(-c, l, 1.0);
}
/* Cody's ratios, n/d: erf(y)/y in s = y^2 below 0.46875 (SMALL), erfc(y) exp(y^2) up to 4 (MID), and for the tail
   (TAIL, t = 1/y^2) erfc(y) exp(y^2) = (1/sqrt(pi) - t n/d)/y */
#define DX_SMALL(s) \
    double ns = 0.18577770618460315, ds = s + 23.601290952344122; \
    ns = DX_FMA(ns, s, 3.1611237438705655); \
    ns = DX_FMA(ns, s, 113.86415415105016); ds = DX_FMA(ds, s, 244.02463793444417); \
    ns = DX_FMA(ns, s, 377.485237685302); ds = DX_FMA(ds, s, 1282.6165260773723); \
    ns = DX_FMA(ns, s, 3209.3775891384694); ds = DX_FMA(ds, s, 2844.236833439171);
#define DX_MID(y) \
    double nm = 2.1531153547440383e-08, dm = y + 15.744926110709835; \
    nm = DX_FMA(nm, y, 0.5641884969886701); \
    nm = DX_FMA(nm, y, 8.883149794388377); dm = DX_FMA(dm, y, 117.6939508913125); \
    nm = DX_FMA(nm, y, 66.11919063714163); dm = DX_FMA(dm, y, 537.1811018620099); \
    nm = DX_FMA(nm, y, 298.6351381974001); dm = DX_FMA(dm, y, 1621.3895745666903); \
    nm = DX_FMA(nm, y, 881.952221241769); dm = DX_FMA(dm, y, 3290.7992357334597); \
    nm = DX_FMA(nm, y, 1712.0476126340707); dm = DX_FMA(dm, y, 4362.619090143247); \
    nm = DX_FMA(nm, y, 2051.0783778260716); dm = DX_FMA(dm, y, 3439.3676741437216); \
    nm = DX_FMA(nm, y, 1230.3393547979972); dm = DX_FMA(dm, y, 1230.3393548037495);
#define DX_TAIL(y) \
    double tt = 1.0 / (y * y); \
    double nt = 0.016315387137302097, dt = tt + 2.568520192289822; \
    nt = DX_FMA(nt, tt, 0.30532663496123236); \
    nt = DX_FMA(nt, tt, 0.36034489994980445); dt = DX_FMA(dt, tt, 1.8729528499234673); \
    nt = DX_FMA(nt, tt, 0.12578172611122926); dt = DX_FMA(dt, tt, 0.5279051029514285); \
    nt = DX_FMA(nt, tt, 0.016083785148742275); dt = DX_FMA(dt, tt, 0.06051834131244132); \
    nt = DX_FMA(nt, tt, 0.0006587491615298378); dt = DX_FMA(dt, tt, 0.0023352049762686918); \
    double tail = (0.56418958354775628695 - tt * (nt / dt)) / y;
/* the ratio r of SMALL (where y < 0.46875) or else of MID, and c = erfc(y) exp(y^2) (TAIL's where `tails` and
   y > 4) */
static inline double dx_cody(double y, int tails, double *c) {
    double s = y * y;
    DX_SMALL(s)
    DX_MID(y)
    int small = y < 0.46875;
    double r = (small ? ns : nm) / (small ? ds : dm);
    *c = r;
    if (tails) {
        DX_TAIL(y)
        *c = y > 4.0 ? tail : r;
    }
    return r;
}
static inline double dx_erf1(double v, int tails) {
    double a = fabs(v), c, r = dx_cody(a, tails, &c);
    double big = copysign(1.0 - dx_gauss(a, 1.0) * c, v);
    return a < 0.46875 ? v * r : big;
}
/* gelu: Phi = 1/2 + z r/2 where |z| < 0.46875 (z = x/sqrt 2), else e h below 0 and 1 - e h above, e = exp(-x^2/2),
   h = erfc(|z|) exp(z^2)/2 */
#define DX_GELU_PARTS \
    double a = fabs(v), z = v * DX_SQRT1_2, c, r = dx_cody(a * DX_SQRT1_2, tails, &c); \
    double e = dx_gauss(a, 0.5), h = 0.5 * c, ps = DX_FMA(0.5 * z, r, 0.5); \
    int small = a < 0.46875 / DX_SQRT1_2;
static inline double dx_gelu1(double v, int tails) {
    DX_GELU_PARTS
    double big = v > 0 ? v * (1.0 - e * h) : (v * e) * h;
    return small ? v * ps : big;
}
static inline double dx_gelugrad1(double v, double g, int tails) {
    DX_GELU_PARTS
    double q = v * DX_INV_SQRT_2PI;
    double big = v > 0 ? DX_FMA(q, e, DX_FMA(-e, h, 1.0)) : e * (h + q);
    return g * (small ? DX_FMA(q, e, ps) : big);
}
#define DX_TAIL_BLOCK 512
/* over blocks of DX_TAIL_BLOCK, the tail form only in those with a value beyond `lim` (nan: not) */
#define DX_BLOCKED(NAME, LIM, BODY) \
void NAME(long n, const double *x, const double *g, double *o) { \
    for (long b = 0; b < n; b += DX_TAIL_BLOCK) { \
        long m = n - b < DX_TAIL_BLOCK ? n - b : DX_TAIL_BLOCK; \
        const double *xb = x + b, *gb = g ? g + b : x + b; \
        double *ob = o + b; \
        int tails = 0; \
        for (long i = 0; i < m; i++) tails |= fabs(xb[i]) > LIM; \
        if (tails) { IVDEP for (long i = 0; i < m; i++) ob[i] = BODY(1); } \
        else { IVDEP for (long i = 0; i < m; i++) ob[i] = BODY(0); } \
    } \
}
#define DX_ERF_BODY(T) dx_erf1(xb[i], T)
#define DX_GELU_BODY(T) dx_gelu1(xb[i], T)
#define DX_GELUGRAD_BODY(T) dx_gelugrad1(xb[i], gb[i], T)
DX_BLOCKED(erf_f64_, 4.0, DX_ERF_BODY)
DX_BLOCKED(gelu_f64_, 4.0 / DX_SQRT1_2, DX_GELU_BODY)
DX_BLOCKED(gelugrad_f64, 4.0 / DX_SQRT1_2, DX_GELUGRAD_BODY)
void erf_f64(long n, const double *x, double *o) { erf_f64_(n, x, 0, o); }
void gelu_f64(long n, const double *x, double *o) { gelu_f64_(n, x, 0, o); }
void gelutanh_f64(long n, const double *x, double *o) {
    IVDEP for (long i = 0; i < n; i++) {
        double v = x[i], u = DX_TANH_K * DX_FMA(0.044715 * v, v * v, v);
        o[i] = v / (1.0 + dx_exp(-2.0 * u));
    }
}
void gelutanhgrad_f64(long n, const double *x, const double *g, double *o) {
    IVDEP for (long i = 0; i < n; i++) {
        double v = x[i], v2 = v * v, u = DX_TANH_K * DX_FMA(0.044715 * v, v2, v);
        double E = dx_exp(-2.0 * u), s = 1.0 / (1.0 + E), c = E < 1.0 ? E * s : 1.0 - s;
        double du = DX_TANH_K * DX_FMA(3.0 * 0.044715, v2, 1.0);
        double second = c == 0.0 ? 0.0 * v : ((2.0 * v) * du) * (s * c);
        o[i] = g[i] * (s + second);
    }
}
"""

#: with MKL's OpenMP runtime: the elementwise kernels again, each thread running the serial loop on its share
_OMP_SHARE = r"""
int omp_get_thread_num(void);
int omp_get_num_threads(void);
/* this thread's share [lo, lo + cnt) of n elements, cut at multiples of 16 (whole cache lines of float32) */
static inline void deepx_share(long n, long *lo, long *cnt) {
    long t = omp_get_thread_num(), k = omp_get_num_threads();
    long a = n * t / k, b = n * (t + 1) / k;
    a -= a % 16;
    b = t + 1 < k ? b - b % 16 : n;
    *lo = a; *cnt = b - a;
}
"""
CORE_OMP = _OMP_SHARE + r"""
#define PRELU(T, S) \
void prelu_##S(long n, const T *x, T *o) { \
    _Pragma("omp parallel") { long lo, c; deepx_share(n, &lo, &c); relu_##S(c, x + lo, o + lo); } \
}
#define PSGD(T, S) \
void psgd_##S(long n, const T *p, const T *g, const T *b, T *po, T *bo, T lr, T m, T keep, T wd, int decay, \
              int momentum, int first, int nesterov, int damp) { \
    _Pragma("omp parallel") { long lo, c; deepx_share(n, &lo, &c); \
        sgd_##S(c, p + lo, g + lo, b + lo, po + lo, bo + lo, lr, m, keep, wd, decay, momentum, first, nesterov, \
                damp); } \
}
#define PADAM(T, S) \
void padam_##S(long n, const T *p, const T *g, const T *m, const T *v, T *po, T *mo, T *vo, T b1, T c1, T b2, \
               T c2, T eps, T wd, T shrink, T step, T bc2s, int decay, int decoupled) { \
    _Pragma("omp parallel") { long lo, c; deepx_share(n, &lo, &c); \
        adam_##S(c, p + lo, g + lo, m + lo, v + lo, po + lo, mo + lo, vo + lo, b1, c1, b2, c2, eps, wd, shrink, \
                 step, bc2s, decay, decoupled); } \
}
PRELU(float, f32) PRELU(double, f64)
PSGD(float, f32) PSGD(double, f64)
PADAM(float, f32) PADAM(double, f64)
#define PSPECIAL1(NAME, T) \
void p##NAME(long n, const T *x, T *o) { \
    _Pragma("omp parallel") { long lo, c; deepx_share(n, &lo, &c); NAME(c, x + lo, o + lo); } \
}
#define PSPECIAL2(NAME, T) \
void p##NAME(long n, const T *x, const T *g, T *o) { \
    _Pragma("omp parallel") { long lo, c; deepx_share(n, &lo, &c); NAME(c, x + lo, g + lo, o + lo); } \
}
PSPECIAL1(erf_f32, float) PSPECIAL1(gelu_f32, float) PSPECIAL1(gelutanh_f32, float)
PSPECIAL2(gelugrad_f32, float) PSPECIAL2(gelutanhgrad_f32, float)
PSPECIAL1(erf_f64, double) PSPECIAL1(gelu_f64, double) PSPECIAL1(gelutanh_f64, double)
PSPECIAL2(gelugrad_f64, double) PSPECIAL2(gelutanhgrad_f64, double)
""" + r"""
/* Skinny products (native.SKINNY): out = a @ b, row-major m x n, where one of m, n, k is at most 16, which MKL
   makes at a fifth of its speed on square ones (a classifier's logits and their gradients). Each output element is
   made by one thread in one fixed order (64-byte vectors of partial sums, then their lanes in a tree), so the bits
   do not depend on the number of threads. Multiply-adds are fused here (the only kernels where they are: a product's
   order differs from numpy's anyway, as MKL's does). The vector types are GCC's: on a machine without AVX-512 the
   compiler splits them into narrower instructions. */
typedef float dx_vf32 __attribute__((vector_size(64), aligned(4)));
typedef double dx_vf64 __attribute__((vector_size(64), aligned(8)));
#if defined(__GNUC__) && !defined(__clang__)
#define DX_FMA __attribute__((optimize("fp-contract=fast")))
#else
#define DX_FMA
#endif
/* n <= 16 columns: out[i, j] = sum_p a[i*lda + p] * bt[j*ldb + p], the N rows of bt kept in the first-level cache */
#define SMALLN_ROWS(T, S, V, W, N) \
DX_FMA static void smalln_##S##_##N(long m0, long m1, long k, const T *a, long lda, const T *bt, long ldb, T *out) { \
    for (long i = m0; i < m1; i++) { \
        const T *ar = a + i * lda; \
        V acc[N]; \
        _Pragma("GCC unroll 16") for (int j = 0; j < N; j++) acc[j] = (V){0}; \
        long p = 0; \
        for (; p + W <= k; p += W) { \
            V x = *(const V *)(ar + p); \
            _Pragma("GCC unroll 16") for (int j = 0; j < N; j++) acc[j] += x * *(const V *)(bt + j * ldb + p); \
        } \
        for (int j = 0; j < N; j++) { \
            T h[W]; \
            memcpy(h, &acc[j], sizeof h); \
            for (int w = W / 2; w >= 1; w /= 2) for (int l = 0; l < w; l++) h[l] += h[l + w]; \
            T s = h[0]; \
            for (long q = p; q < k; q++) s += ar[q] * bt[j * ldb + q]; \
            out[i * N + j] = s; \
        } \
    } \
}
/* k <= 16: out[i, j] = a(i, 0) * b[j] + a(i, 1) * b[ldb + j] + ..., a(i, p) = a[i*sar + p*sac] */
#define SMALLK(T, S, V, W) \
DX_FMA static void smallk_rows_##S(long m0, long m1, long n, long k, const T *a, long sar, long sac, const T *b, \
                                   long ldb, T *out) { \
    for (long i = m0; i < m1; i++) { \
        T av[16]; \
        for (long p = 0; p < k; p++) av[p] = a[i * sar + p * sac]; \
        T *o = out + i * n; \
        long j = 0; \
        for (; j + 4 * W <= n; j += 4 * W) { \
            V acc[4]; \
            for (int q = 0; q < 4; q++) acc[q] = av[0] * *(const V *)(b + j + q * W); \
            for (long p = 1; p < k; p++) { \
                const T *bp = b + p * ldb + j; T x = av[p]; \
                for (int q = 0; q < 4; q++) acc[q] += x * *(const V *)(bp + q * W); \
            } \
            for (int q = 0; q < 4; q++) *(V *)(o + j + q * W) = acc[q]; \
        } \
        for (; j < n; j++) { T s = av[0] * b[j]; for (long p = 1; p < k; p++) s += av[p] * b[p * ldb + j]; o[j] = s; } \
    } \
} \
void smallk_##S(long m, long n, long k, const T *a, long sar, long sac, const T *b, long ldb, T *out) { \
    _Pragma("omp parallel") { \
        long t = omp_get_thread_num(), c = omp_get_num_threads(); \
        smallk_rows_##S(m * t / c, m * (t + 1) / c, n, k, a, sar, sac, b, ldb, out); \
    } \
}
/* m <= 16 rows: out[r, j] = sum_p a(r, p) * b[p*ldb + j], blocks of 2W columns shared among the threads */
#define SMALLM_COLS(T, S, V, W, M) \
DX_FMA static void smallm_##S##_##M(long j0, long j1, long n, long k, const T *a, long sar, long sac, const T *b, \
                                    long ldb, T *out) { \
    long j = j0; \
    for (; j + 2 * W <= j1; j += 2 * W) { \
        V acc[M][2]; \
        _Pragma("GCC unroll 16") for (int r = 0; r < M; r++) { acc[r][0] = (V){0}; acc[r][1] = (V){0}; } \
        for (long p = 0; p < k; p++) { \
            const T *bp = b + p * ldb + j; V b0 = *(const V *)bp, b1 = *(const V *)(bp + W); \
            _Pragma("GCC unroll 16") for (int r = 0; r < M; r++) { \
                T x = a[r * sar + p * sac]; acc[r][0] += x * b0; acc[r][1] += x * b1; \
            } \
        } \
        for (int r = 0; r < M; r++) { *(V *)(out + r * n + j) = acc[r][0]; *(V *)(out + r * n + j + W) = acc[r][1]; } \
    } \
    for (; j < j1; j++) \
        for (int r = 0; r < M; r++) { \
            T s = 0; for (long p = 0; p < k; p++) s += a[r * sar + p * sac] * b[p * ldb + j]; out[r * n + j] = s; \
        } \
}
#define DX_16(F, T, S, V, W) F(T,S,V,W,1) F(T,S,V,W,2) F(T,S,V,W,3) F(T,S,V,W,4) F(T,S,V,W,5) F(T,S,V,W,6) \
    F(T,S,V,W,7) F(T,S,V,W,8) F(T,S,V,W,9) F(T,S,V,W,10) F(T,S,V,W,11) F(T,S,V,W,12) F(T,S,V,W,13) F(T,S,V,W,14) \
    F(T,S,V,W,15) F(T,S,V,W,16)
#define DX_CASES(C, S) C(S,1) C(S,2) C(S,3) C(S,4) C(S,5) C(S,6) C(S,7) C(S,8) C(S,9) C(S,10) C(S,11) C(S,12) \
    C(S,13) C(S,14) C(S,15) default: C(S,16)
#define CASE_N(S, N) case N: smalln_##S##_##N(m * t / c, m * (t + 1) / c, k, a, lda, bt, ldb, out); break;
#define CASE_M(S, M) case M: smallm_##S##_##M(j0, j1, n, k, a, sar, sac, b, ldb, out); break;
#define SKINNY(T, S, V, W) \
DX_16(SMALLN_ROWS, T, S, V, W) \
void smalln_##S(long m, long n, long k, const T *a, long lda, const T *bt, long ldb, T *out) { \
    _Pragma("omp parallel") { \
        long t = omp_get_thread_num(), c = omp_get_num_threads(); \
        switch (n) { DX_CASES(CASE_N, S) } \
    } \
} \
SMALLK(T, S, V, W) \
DX_16(SMALLM_COLS, T, S, V, W) \
void smallm_##S(long m, long n, long k, const T *a, long sar, long sac, const T *b, long ldb, T *out) { \
    _Pragma("omp parallel") { \
        long t = omp_get_thread_num(), c = omp_get_num_threads(), blocks = (n + 2 * W - 1) / (2 * W); \
        long j0 = blocks * t / c * 2 * W, j1 = t + 1 < c ? blocks * (t + 1) / c * 2 * W : n; \
        if (j0 > n) j0 = n; \
        if (j1 > n) j1 = n; \
        switch (m) { DX_CASES(CASE_M, S) } \
    } \
}
SKINNY(float, f32, dx_vf32, 16) SKINNY(double, f64, dx_vf64, 8)
"""

_PTR = ctypes.c_void_p
_LONG = ctypes.c_long
_INT = ctypes.c_int
_core_fns: dict[str, Any] | None = None


def _core() -> dict[str, Any] | None:
    """The fixed library's kernels, or None (numpy runs). Its first build on a machine takes about a second: in the
    background (as a HOT fused expression's, set_background), the kernels running on numpy meanwhile."""
    global _core_thread
    if _core_fns is not None:
        return _core_fns
    if not _background:
        return _build_core()
    with _building_lock:
        if _core_thread is None and available():
            _core_thread = threading.Thread(target=_build_core_in_background, name="deepx-native-core",
                                            daemon=True)
            try:
                _core_thread.start()
            except RuntimeError:  # no thread to be had: the build on the spot
                _core_thread = None
                return _build_core()
    return _core_fns


def _build_core_in_background() -> None:
    global _core_thread
    try:
        _build_core()
    except Exception:  # never seen: load() logs and returns None for what it cannot build
        log.exception("native kernels: building the fixed library failed; its kernels run on numpy")
    # failed for good (load() keeps the failure): not tried again, _core_thread stays set; built, or native kernels
    # turned off meanwhile: asked again, it is tried again
    if _core_fns is not None or not available():
        with _building_lock:
            _core_thread = None


def _build_core() -> dict[str, Any] | None:
    global _core_fns
    if _core_fns is not None:
        return _core_fns
    omp = _omp() is not None
    lib = load(CORE + CORE_OMP, openmp=True) if omp else load(CORE)
    if lib is None and omp:  # the OpenMP build failed (logged): the serial kernels
        lib = load(CORE)
        omp = False
    if lib is None:
        return None
    fns = {}
    for dt, s in SUFFIX.items():
        real = ctypes.c_float if dt == F32 else ctypes.c_double
        f = getattr(lib, f"relu_{s}")
        f.argtypes, f.restype = [_LONG, _PTR, _PTR], None
        fns[f"relu_{s}"] = f
        f = getattr(lib, f"sgd_{s}")
        f.argtypes, f.restype = [_LONG, *[_PTR] * 5, *[real] * 4, *[_INT] * 5], None
        fns[f"sgd_{s}"] = f
        f = getattr(lib, f"adam_{s}")
        f.argtypes, f.restype = [_LONG, *[_PTR] * 7, *[real] * 9, _INT, _INT], None
        fns[f"adam_{s}"] = f
        f = getattr(lib, f"rowshift_{s}")
        f.argtypes, f.restype = [_LONG, _LONG, _PTR, _PTR], None
        fns[f"rowshift_{s}"] = f
        f = getattr(lib, f"cerows_{s}")
        f.argtypes, f.restype = [_LONG, _LONG, *[_PTR] * 5], None
        fns[f"cerows_{s}"] = f
        f = getattr(lib, f"cegrad_{s}")
        f.argtypes, f.restype = [_LONG, _LONG, _PTR, _PTR, _PTR, ctypes.c_longlong, _INT], None
        fns[f"cegrad_{s}"] = f
        f = getattr(lib, f"ceprep_{s}")
        f.argtypes, f.restype = [_LONG, _LONG, _PTR, _PTR, ctypes.c_longlong, _PTR, _PTR], _INT
        fns[f"ceprep_{s}"] = f
        f = getattr(lib, f"cesums_{s}")
        f.argtypes, f.restype = [_LONG, _LONG, _PTR, _PTR], None
        fns[f"cesums_{s}"] = f
        f = getattr(lib, f"cereduce_{s}")
        f.argtypes, f.restype = [_LONG, _PTR, _PTR, _INT, _PTR], None
        fns[f"cereduce_{s}"] = f
        f = getattr(lib, f"colsum_{s}")
        f.argtypes, f.restype = [_LONG, _LONG, _PTR, _PTR], None
        fns[f"colsum_{s}"] = f
        for name in SPECIAL:
            for split in ("p", "") if omp else ("",):
                f = getattr(lib, f"{split}{name}_{s}")
                f.argtypes, f.restype = [_LONG, *[_PTR] * (3 if name.endswith("grad") else 2)], None
                fns[f"{split}{name}_{s}"] = f
        if omp:  # the split versions of the elementwise kernels, with their serial ones' arguments
            for name in ("relu", "sgd", "adam"):
                f = getattr(lib, f"p{name}_{s}")
                f.argtypes, f.restype = fns[f"{name}_{s}"].argtypes, None
                fns[f"p{name}_{s}"] = f
            f = getattr(lib, f"smalln_{s}")  # the skinny products (small_product)
            f.argtypes, f.restype = [_LONG, _LONG, _LONG, _PTR, _LONG, _PTR, _LONG, _PTR], None
            fns[f"smalln_{s}"] = f
            for name in ("smallk", "smallm"):
                f = getattr(lib, f"{name}_{s}")
                f.argtypes, f.restype = [_LONG, _LONG, _LONG, _PTR, _LONG, _LONG, _PTR, _LONG, _PTR], None
                fns[f"{name}_{s}"] = f
    _core_fns = fns
    return fns


_CHAR = ctypes.c_char
_addressof = ctypes.addressof


def fits(arrays: Sequence[np.ndarray], outs: Sequence[np.ndarray], dt: np.dtype, n: int) -> list[int] | None:
    """The addresses of the arrays then the outputs, where a C loop over n elements may take them: all
    C-contiguous of dtype `dt` and n elements, each output writable and either one of the inputs (the same buffer:
    an update in place) or apart from every input and every other output. None where it may not."""
    where = []
    for a in arrays:
        if (a.dtype is not dt and a.dtype != dt) or a.size != n:
            return None
        try:
            where.append(_addressof(_CHAR.from_buffer(a)))  # type: ignore[arg-type]  # C-contiguous and writable
        except (TypeError, ValueError):  # read-only, empty, or strided
            if not a.flags.c_contiguous:
                return None
            where.append(a.__array_interface__["data"][0])
    size = n * dt.itemsize
    k = len(where)
    for o in outs:
        if (o.dtype is not dt and o.dtype != dt) or o.size != n:
            return None
        try:
            lo = _addressof(_CHAR.from_buffer(o))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            if n or not o.flags.writeable or not o.flags.c_contiguous:
                return None
            lo = o.__array_interface__["data"][0]
        if lo in where[k:]:
            return None  # two outputs in one buffer
        for other in where:  # an input it is (the same buffer) is read at the same index; any other overlap is not
            if other != lo and other < lo + size and lo < other + size:
                return None
        where.append(lo)
    return where


def _parts(n: int, per_thread: int = THREAD_MIN) -> int:
    """How many threads share a loop over n elements (at least `per_thread` each)."""
    return max(1, min(MAX_THREADS, n // per_thread))


def _pieces(n: int, per_thread: int = THREAD_MIN) -> list[tuple[int, int]]:
    parts = _parts(n, per_thread)
    edges = [n * k // parts for k in range(parts + 1)]
    return [(edges[k], edges[k + 1]) for k in range(parts) if edges[k + 1] > edges[k]]


def _split_call(fns: dict[str, Any], name: str, n: int, base: Sequence[int], rest: Sequence[Any],
                itemsize: int, per_thread: int = THREAD_MIN) -> None:
    """Kernel `name` (count, *pointers, *rest) over n elements: from OMP_MIN elements on MKL's OpenMP threads where
    the library has them ("p" + name), else in pieces of at least `per_thread` on the fused kernels' threads."""
    if n >= OMP_MIN and _split_on:
        split = fns.get("p" + name)
        if split is not None:
            split(n, *base, *rest)
            return
    fn = fns[name]
    if n < 2 * per_thread or MAX_THREADS == 1:
        fn(n, *base, *rest)
        return
    pieces = _pieces(n, per_thread)
    from deepxd.kernels.cpu.fused import _threads

    futures = [_threads().submit(fn, hi - lo, *[b + lo * itemsize for b in base], *rest) for lo, hi in pieces[1:]]
    lo, hi = pieces[0]
    fn(hi - lo, *base, *rest)
    for f in futures:
        f.result()


#: skinny products (small_product): which shapes go to the native loops instead of MKL, as measured on the MLP's
#: classifier layer and a grid of sizes (bench/kernels.py, `skinny`):
#:   k of 2-12, with m x n outputs of 4096 or more and rows of at least 256 bytes (64 float32 columns);
#:   n of 2-12 columns whose rows of b (n x k) fit in 20 KB, the first-level cache;
#:   m of 4-12 rows, a depth up to 1024, and rows made of whole 128-byte blocks (32 float32 columns).
#: Outside these MKL was as fast or faster (one column or row is a matrix-vector product, which it does well; the
#: loops' scalar tails are slow). The C loops take at most 16 (SKINNY_MAX).
SKINNY = (2, 12)
SKINNY_MAX = 16
SKINNY_OUT = 1 << 12
SKINNY_ROW_BYTES = 256
SKINNY_B_BYTES = 20 << 10
SKINNY_M = 4
SKINNY_DEPTH = 1024
SKINNY_BLOCK_BYTES = 128
#: ...and only products of this many multiply-adds or more: below, opening the OpenMP team costs more than MKL's
#: small-matrix path takes (a tiny MLP's 16x8 @ 8x8 products: 10 us a step lost over eight of them)
SKINNY_WORK = 1 << 15


def small_product(a: np.ndarray, b: np.ndarray, out: np.ndarray, ta: bool, lda: int, tb: bool, ldb: int) -> bool:
    """out = a @ b (2-D, float32 or float64, out C-contiguous and apart from both) on the skinny products' loops
    when its shape is one they make faster than MKL (SKINNY); False where MKL must. ta, tb: a, b are read
    column-major (transposed views) with leading dimensions lda, ldb (blas._layout's answer).

    The loops give other bits than MKL, so the library is built (or loaded from the cache) on the spot the first
    time, not in the background: a product never changes its bits because a build has finished meanwhile."""
    if not _split_on or not _enabled:
        return False
    m, k = a.shape
    n = b.shape[1]
    if m * n * k < SKINNY_WORK:
        return False
    lo, hi = SKINNY[0], min(SKINNY[1], SKINNY_MAX)
    item = out.itemsize
    if lo <= k <= hi and m * n >= SKINNY_OUT and n * item >= SKINNY_ROW_BYTES:
        kind = "smallk"
    elif lo <= n <= hi and not ta and n * k * item <= SKINNY_B_BYTES:
        kind = "smalln"
    elif max(lo, SKINNY_M) <= m <= hi and not tb and k <= SKINNY_DEPTH and not (n * item) % SKINNY_BLOCK_BYTES:
        kind = "smallm"
    else:
        return False
    fns = _core_fns if _core_fns is not None else _build_core()
    if fns is None:
        return False
    fn = fns.get(f"{kind}_{SUFFIX[out.dtype]}")
    if fn is None:  # built without OpenMP
        return False
    if kind == "smallk":
        if tb:  # k rows of b, copied to be read along them
            b = np.ascontiguousarray(b)
            ldb = n
        fn(m, n, k, _address(a), 1 if ta else lda, lda if ta else 1, _address(b), ldb, _address(out))
    elif kind == "smalln":
        bt = b if tb else np.ascontiguousarray(b.T)  # n rows of k: b's columns
        fn(m, n, k, _address(a), lda, _address(bt), ldb if tb else k, _address(out))
    else:
        fn(m, n, k, _address(a), 1 if ta else lda, lda if ta else 1, _address(b), ldb, _address(out))
    return True


#: the special functions of the fixed library: erf, gelu and its tanh form, and their gradients (x, then g)
SPECIAL = ("erf", "gelu", "gelutanh", "gelugrad", "gelutanhgrad")


def special(name: str, ins: Sequence[np.ndarray], out: np.ndarray) -> bool:
    """out = `name` (one of SPECIAL) of ins, float32 or float64, in one pass; False where the caller must use numpy.

    These give other bits than the numpy code they replace (float32 evaluates in float32: docs/compiler.md, "erf and
    gelu"), so the library is built (or loaded from the cache) on the spot the first time, as for small_product: a
    kernel never changes its bits because a build has finished meanwhile."""
    dt = out.dtype
    if dt not in SUFFIX or not _enabled:
        return False
    fns = _core_fns if _core_fns is not None else _build_core()
    where = fits(ins, (out,), dt, out.size) if fns is not None else None
    if fns is None or where is None:
        return False
    _split_call(fns, f"{name}_{SUFFIX[dt]}", out.size, where, (), dt.itemsize, SPECIAL_THREAD_MIN)
    return True


def relu(a: np.ndarray, out: np.ndarray) -> bool:
    """out = maximum(a, 0) (NaN kept) in one pass; False where the caller must use numpy."""
    dt = out.dtype
    if dt not in SUFFIX or not _enabled:
        return False
    fns = _core()
    where = fits((a,), (out,), dt, out.size) if fns is not None else None
    if fns is None or where is None:
        return False
    _split_call(fns, f"relu_{SUFFIX[dt]}", out.size, where, (), dt.itemsize)
    return True


def sgd(param: np.ndarray, grad: np.ndarray, buf: np.ndarray, lr: float, momentum: float, dampening: float,
        weight_decay: float, nesterov: bool, first: bool, param_out: np.ndarray, buf_out: np.ndarray) -> bool:
    """One SGD update in one pass (optim.sgd's formula); False where the caller must use numpy."""
    dt = param.dtype
    if dt not in SUFFIX or not _enabled:
        return False
    fns = _core()
    n = param.size
    if fns is None:
        return False
    if momentum:
        where = fits((param, grad, buf), (param_out, buf_out), dt, n)
    else:
        where = fits((param, grad), (param_out,), dt, n)
        if where is not None:  # buf is neither read nor written: the param's address stands in for it
            where = [where[0], where[1], where[0], where[2], where[2]]
    if where is None:
        return False
    _split_call(fns, f"sgd_{SUFFIX[dt]}", n, where, _sgd_numbers(dt, lr, momentum, dampening, weight_decay, nesterov,
                                                                 first), dt.itemsize)
    return True


def _sgd_numbers(dt: np.dtype, lr: float, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                 first: bool) -> tuple[Any, ...]:
    """The sgd loop's arguments after its pointers, in its dtype: lr, momentum, 1 - dampening, weight_decay and
    the flags (decay, momentum, first step, nesterov, dampening)."""
    real = dt.type
    return (real(lr), real(momentum), real(1 - dampening), real(weight_decay), int(bool(weight_decay)),
            int(bool(momentum)), int(first), int(bool(nesterov)), int(dampening != 0))


def sgd_call(dt: np.dtype, n: int, lr: float, momentum: float, dampening: float, weight_decay: float,
             nesterov: bool, first: bool) -> Callable[..., bool] | None:
    """`sgd` for one instruction of a program that runs again and again (n elements of dtype dt, these numbers):
    the loop and its converted numbers found once; each call(param, grad, buf, param_out, buf_out) checks the arrays
    and runs it, or returns False where `sgd` must decide (an output that is not its input, arrays that overlap).
    None where the native loop would not run at all."""
    dt = np.dtype(dt)
    if dt not in SUFFIX or n < SGD_CALL_MIN or not available():
        return None
    name = f"sgd_{SUFFIX[dt]}"
    loops: list[Any] = []  # [split, serial], found at the first call after the fixed library is built

    def found() -> bool:
        fns = _core()  # None while it builds in the background: sgd's numpy path meanwhile
        if fns is None:
            return False
        loops[:] = [fns.get("p" + name) if n >= OMP_MIN else None,
                    fns[name] if n < 2 * THREAD_MIN or MAX_THREADS == 1 else None]  # else Python's threads: sgd's
        return True
    args = _sgd_numbers(dt, lr, momentum, dampening, weight_decay, nesterov, first)
    size = n * dt.itemsize
    with_buf = bool(momentum)

    def call(param: np.ndarray, grad: np.ndarray, buf: np.ndarray, param_out: np.ndarray,
             buf_out: np.ndarray) -> bool:
        if not _enabled or param_out is not param or (with_buf and buf_out is not buf) or (not loops and not found()):
            return False
        try:
            p = _addressof(_CHAR.from_buffer(param))  # type: ignore[arg-type]  # C-contiguous and writable
            b = _addressof(_CHAR.from_buffer(buf)) if with_buf else p  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False
        if not grad.flags.c_contiguous:
            return False
        g = grad.__array_interface__["data"][0]
        for a in (param, grad, buf) if with_buf else (param, grad):
            if a.size != n or (a.dtype is not dt and a.dtype != dt):
                return False
        if (g < p + size and p < g + size) or (with_buf and ((b < p + size and p < b + size)
                                                              or (g < b + size and b < g + size))):
            return False
        split, serial = loops
        fn = split if split is not None and _split_on else serial
        if fn is None:
            return False
        fn(n, p, g, b, p, b, *args)
        return True

    return call


def adam(param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, lr: float, beta1: float, beta2: float,
         eps: float, weight_decay: float, step: int, decoupled: bool, p_out: np.ndarray, m_out: np.ndarray,
         v_out: np.ndarray) -> bool:
    """One Adam or AdamW update in one pass (optim._adam's formula); False where the caller must use numpy."""
    dt = param.dtype
    if dt not in SUFFIX or not _enabled:
        return False
    fns = _core()
    where = fits((param, grad, m, v), (p_out, m_out, v_out), dt, param.size) if fns is not None else None
    if fns is None or where is None:
        return False
    args = _adam_numbers(dt, lr, beta1, beta2, eps, weight_decay, step, decoupled)
    _split_call(fns, f"adam_{SUFFIX[dt]}", param.size, where, args, dt.itemsize)
    return True


def _adam_numbers(dt: np.dtype, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                  decoupled: bool) -> tuple[Any, ...]:
    """The adam loop's arguments after its pointers, in its dtype: b1, 1 - b1, b2, 1 - b2, eps, weight_decay, the
    decoupled shrink, lr / bc1, sqrt(bc2), and the flags (decay, decoupled). The last set is kept: a step's updates
    (one per parameter) share their numbers."""
    global _last_adam
    key = (lr, beta1, beta2, eps, weight_decay, step, decoupled)
    last = _last_adam
    if last is not None and last[0] is dt and last[1] == key and all(
            type(a) is type(b) and (a or math.copysign(1.0, a) == math.copysign(1.0, b)) for a, b in zip(last[1], key)):
        return last[2]
    args = _adam_numbers_of(dt, lr, beta1, beta2, eps, weight_decay, step, decoupled)
    _last_adam = (dt, key, args)
    return args


_last_adam: tuple[np.dtype, tuple[Any, ...], tuple[Any, ...]] | None = None  # the last _adam_numbers: dtype, key, args


def _adam_numbers_of(dt: np.dtype, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                     step: int, decoupled: bool) -> tuple[Any, ...]:
    real = dt.type
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    return (real(beta1), real(1 - beta1), real(beta2), real(1 - beta2), real(eps), real(weight_decay),
            real(1 - lr * weight_decay), real(lr / bc1), real(math.sqrt(bc2)), int(bool(weight_decay)),
            int(bool(decoupled)))


class AdamCall:
    """`adam` for one instruction of a program that runs again and again (n elements of dtype dt), as sgd_call: the
    loop found once and its numbers converted once per set (`renumber`: an update's step count changes every step);
    each call(param, grad, m, v) updates the three in place, or returns False where `adam` or numpy must decide
    (arrays that overlap or are not what was planned). Made by adam_call."""

    __slots__ = ("args", "dt", "loops", "n", "size")

    def __init__(self, dt: np.dtype, n: int) -> None:
        self.dt, self.n, self.size = dt, n, n * dt.itemsize
        self.args: tuple[Any, ...] = ()
        self.loops: list[Any] = []  # [split, serial], found at the first call after the fixed library is built

    def renumber(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 decoupled: bool) -> bool:
        """Take these numbers; False (and no call until numbers that convert) where they do not convert."""
        try:
            self.args = _adam_numbers(self.dt, lr, beta1, beta2, eps, weight_decay, step, decoupled)
        except (TypeError, ValueError, OverflowError, ZeroDivisionError):  # the kernel words it
            self.args = ()
            return False
        return True

    def _found(self) -> bool:
        fns = _core()  # None while it builds in the background: numpy's path meanwhile
        if fns is None:
            return False
        n, name = self.n, f"adam_{SUFFIX[self.dt]}"
        self.loops[:] = [fns.get("p" + name) if n >= OMP_MIN else None,
                         fns[name] if n < 2 * THREAD_MIN or MAX_THREADS == 1 else None]  # else Python's threads
        return True

    def __call__(self, param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray) -> bool:
        args = self.args
        if not _enabled or not args or (not self.loops and not self._found()):
            return False
        try:
            p = _addressof(_CHAR.from_buffer(param))  # type: ignore[arg-type]  # C-contiguous and writable
            a = _addressof(_CHAR.from_buffer(m))  # type: ignore[arg-type]
            b = _addressof(_CHAR.from_buffer(v))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False
        if not grad.flags.c_contiguous:
            return False
        g = grad.__array_interface__["data"][0]
        n, dt, size = self.n, self.dt, self.size
        for x in (param, grad, m, v):
            if x.size != n or (x.dtype is not dt and x.dtype != dt):
                return False
        for x, y in ((p, g), (p, a), (p, b), (g, a), (g, b), (a, b)):
            if x < y + size and y < x + size:
                return False
        split, serial = self.loops
        fn = split if split is not None and _split_on else serial
        if fn is None:
            return False
        fn(n, p, g, a, b, p, a, b, *args)
        return True


def adam_call(dt: np.dtype, n: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              step: int, decoupled: bool) -> AdamCall | None:
    """An AdamCall for n elements of dtype dt with these numbers. Any size from ADAM_CALL_MIN: numpy's path makes ten
    passes and as many temporaries, which cost more than the call from a few elements on. None where the native
    loop would not run at all, or the numbers do not convert (the kernel words them)."""
    dt = np.dtype(dt)
    if dt not in SUFFIX or n < ADAM_CALL_MIN or not available():
        return None
    call = AdamCall(dt, n)
    return call if call.renumber(lr, beta1, beta2, eps, weight_decay, step, decoupled) else None


def crossentropy_rows(logits: np.ndarray, labels: np.ndarray) -> np.ndarray | None:
    """log(sum(exp(shifted row))) - shifted[row, label] per row (crossentropy's usual batch: every label in range),
    as nn.crossentropy's numpy steps give it: the rows shifted, and the sums and picks made in C, numpy's exp and log
    in between (their bits). None where the caller must use numpy."""
    dt = logits.dtype
    if dt not in SUFFIX or not _enabled or logits.ndim != 2 or not logits.flags.c_contiguous:
        return None
    n, c = logits.shape
    fns, lab = _ce_setup(n, c, labels)
    if fns is None:
        return None
    s = np.empty_like(logits)
    sfx = SUFFIX[dt]
    fns[f"rowshift_{sfx}"](n, c, _address(logits), _address(s))
    e = np.exp(s)
    rs, ps = np.empty(n, dt), np.empty(n, dt)
    fns[f"cerows_{sfx}"](n, c, _address(e), _address(s), _address(lab), _address(rs), _address(ps))
    np.log(rs, out=rs)
    return rs - ps


def _ce_setup(n: int, c: int, labels: np.ndarray) -> tuple[dict[str, Any] | None, np.ndarray]:
    """The kernels and the labels as int64 (the same array where they already are) for crossentropy's C loops over
    n rows of c classes; no kernels where they cannot run (no rows or classes, labels of another dtype or count)."""
    fns = _core()
    if fns is None or not n or not c or labels.dtype not in (np.int64, np.int32) or labels.size != n:
        return None, labels
    return fns, np.ascontiguousarray(labels, np.int64)


def crossentropy_reduced(logits: np.ndarray, labels: np.ndarray, ignore_index: int, mode: int,
                         out: np.ndarray) -> bool:
    """crossentropy's mean (mode 0) or sum (1) over the usual batch (every label in range, none ignored) as
    nn.crossentropy's numpy steps give it, in three C loops around numpy's exp and log (their bits): the labels
    checked and the rows shifted in one, the row sums in the next, the reduction in the last. False where the caller
    must use numpy (an unusual batch among them)."""
    dt = logits.dtype
    if (dt not in SUFFIX or not _enabled or logits.ndim != 2 or not logits.flags.c_contiguous or out.dtype != dt
            or out.size != 1 or not out.flags.c_contiguous or not out.flags.writeable):
        return False
    n, c = logits.shape
    fns, lab = _ce_setup(n, c, labels)
    if fns is None:
        return False
    buf = np.empty(n * c + 2 * n, dt)  # the shifted rows, then their sums, then the picked values
    s, rs = buf[:n * c], buf[n * c:n * c + n]
    sfx = SUFFIX[dt]
    at, item = _address(buf), dt.itemsize
    sums, picked = at + n * c * item, at + (n * c + n) * item
    if fns[f"ceprep_{sfx}"](n, c, _address(logits), _address(lab), int(ignore_index), at, picked):
        return False
    np.exp(s, out=s)
    fns[f"cesums_{sfx}"](n, c, at, sums)
    np.log(rs, out=rs)
    fns[f"cereduce_{sfx}"](n, sums, picked, mode, _address(out))
    return True


def colsum(a: np.ndarray, k: int, out: np.ndarray) -> bool:
    """out = a summed over its first k axes, in numpy's order (row after row); False where the caller must use
    numpy: not float32/float64, not C-contiguous, or fewer than two values per row (numpy then sums pairwise)."""
    dt = a.dtype
    if dt not in SUFFIX or not _enabled or out.dtype != dt or not a.flags.c_contiguous or not a.size:
        return False
    rows = 1
    for d in a.shape[:k]:
        rows *= d
    cols = a.size // rows
    fns = _core()
    if fns is None or cols < 2 or out.size != cols or not out.flags.c_contiguous or not out.flags.writeable:
        return False
    lo, hi = _address(out), _address(a)
    if lo < hi + a.nbytes and hi < lo + out.nbytes:
        return False
    fns[f"colsum_{SUFFIX[dt]}"](rows, cols, hi, lo)
    return True


def crossentropygrad(logits: np.ndarray, labels: np.ndarray, g: np.ndarray, ignore_index: int, mode: int,
                     out: np.ndarray) -> bool:
    """crossentropy's gradient (nn.crossentropygrad) in two C loops around numpy's exp, which gives exp's bits:
    the rows shifted by their max into `out`, exp in place, then the softmax and the rest in one pass. mode: 0 mean,
    1 sum, 2 none. False where the caller must use numpy."""
    dt = out.dtype
    if dt not in SUFFIX or not _enabled or out.ndim != 2 or logits.dtype != dt or g.dtype != dt:
        return False
    n, c = out.shape
    fns, lab = _ce_setup(n, c, labels)
    if fns is None:
        return False
    gg = np.ascontiguousarray(g)
    where = fits((logits,), (out,), dt, n * c)
    if where is None or (mode == 2 and gg.size != n) or (mode != 2 and gg.size != 1):
        return False
    sfx = SUFFIX[dt]
    fns[f"rowshift_{sfx}"](n, c, where[0], where[1])
    np.exp(out, out=out)
    fns[f"cegrad_{sfx}"](n, c, where[1], _address(lab), _address(gg), int(ignore_index), mode)
    return True


# ------------------------------------------------------------------ fused expressions

#: the calls a generated kernel makes itself; the others (exp, log, ...) keep the expression on numpy
_C_CALLS = {"sqrt": "sqrt", "abs": "fabs", "maximum": "deepx_max", "minimum": "deepx_min"}
_C_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_C_COMPARE = {ast.Gt: ">", ast.Lt: "<", ast.GtE: ">=", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!="}

#: input layouts: the output's shape, one element, the output's trailing dimensions (a row repeated), or its leading
#: dimensions (a column: one value per row)
FULL, SCALAR, ROW, COLUMN = 0, 1, 2, 3
_INDEX = {FULL: "i", ROW: "j", COLUMN: "r"}  # the element an input of that layout gives at row r, column j

_FusedKey = tuple[str, int, str, tuple[int, ...], bool]
_seen: Cache[_FusedKey, int] = Cache("kernels.cpu.native.seen", 4096, counted=False)
_consts: Cache[tuple[str, tuple[float, ...], np.dtype], np.ndarray] = Cache("kernels.cpu.native.consts", 4096,
                                                                              counted=False)
_fused_fns: Cache[_FusedKey, Any] = Cache("kernels.cpu.native.fused_fns", 4096)
_fused_split: Cache[_FusedKey, Any] = Cache("kernels.cpu.native.fused_split", 4096)  # pfused, built with OpenMP


def fused_source(tree: ast.Expression, ctype: str, layouts: Sequence[int], colsum: bool = False,
                 openmp: bool = False) -> str | None:
    """C source of `void fused(long rows, long cols, const T **in, const T *c, T *out)` for a checked expression
    whose numbers are lifted into c0, c1, ... (fused.compile_expr's text), or None when it calls what numpy does
    better. Inputs of layout FULL are read at [r*cols + j], ROW at [j], COLUMN at [r], SCALAR at [0]; constant k at
    c[k], a value the compiler does not know, so it folds nothing that numpy computes (0/0, x*1, -(x*c) as x*-c
    would each change a NaN's sign or quietness). Negation flips the sign bit, as numpy's does. colsum: the function
    takes a last argument `T *sums` and also writes the output's column sums there, row after row from +0 (a sum over
    axis 0 of the output, in numpy's order). openmp: also `pfused`, of the same arguments, which splits the loop
    across the threads of an OpenMP team (the rows; with colsum, the column sums by columns after a barrier)."""
    lines: list[str] = []
    ids: dict[str, str] = {}
    math_suffix = "f" if ctype == "float" else ""

    def visit(node: ast.expr) -> str | None:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd):
            return visit(node.operand)
        key = ast.dump(node)
        if key in ids:
            return ids[key]
        if isinstance(node, ast.Name) and node.id.startswith("c"):
            text = node.id  # a constant, read once before the loop
        elif isinstance(node, ast.Name):
            k = int(node.id[2:])
            text = f"s{k}" if layouts[k] == SCALAR else f"in{k}[{_INDEX[layouts[k]]}]"
        elif isinstance(node, ast.BinOp):
            op = _C_BINARY.get(type(node.op))
            left, right = visit(node.left), visit(node.right)
            if op is None or left is None or right is None:
                return None
            text = f"{left} {op} {right}"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = visit(node.operand)
            if inner is None:
                return None
            text = f"deepx_neg({inner})"
        elif isinstance(node, ast.Compare):
            left, right = visit(node.left), visit(node.comparators[0])
            if left is None or right is None:
                return None
            text = f"({ctype})({left} {_C_COMPARE[type(node.ops[0])]} {right})"
        elif isinstance(node, ast.Call):
            assert isinstance(node.func, ast.Name)
            fn = _C_CALLS.get(node.func.id)
            args = [visit(a) for a in node.args]
            if fn is None or any(a is None for a in args):
                return None
            if fn in ("sqrt", "fabs"):
                fn += math_suffix
            text = f"{fn}({', '.join(args)})"  # type: ignore[arg-type]
        else:
            return None
        name = f"t{len(ids)}"
        lines.append(f"                {ctype} {name} = {text};")
        ids[key] = name
        return name

    root = visit(tree.body)
    if root is None:
        return None
    T = ctype
    n_consts = len({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id.startswith("c")})
    consts = "".join(f"    const {T} c{k} = c[{k}];\n" for k in range(n_consts))
    scalars = consts + "".join(f"    const {T} s{k} = in[{k}][0];\n" for k, lay in enumerate(layouts) if lay == SCALAR)
    pointers = "".join(f"    const {T} *in{k} = in[{k}];\n" for k, lay in enumerate(layouts) if lay != SCALAR)
    body = "\n".join(lines)
    bits = "unsigned int" if T == "float" else "unsigned long long"
    extra = f", {T} *sums" if colsum else ""
    start = f"    if (sums) for (long j = j0; j < j1; j++) sums[j] = ({T})0;\n" if colsum else ""
    accumulate = f"\n            if (sums) sums[j] = sums[j] + {root};" if colsum else ""
    args = "in, c, out, sums" if colsum else "in, c, out"
    if colsum:  # the elementwise part split by rows, then the column sums split by columns, each in numpy's order
        split_body = f"""        fused_range(rows * t / k, rows * (t + 1) / k, 0, cols, cols, in, c, out, 0);
        _Pragma("omp barrier")
        long off = (long)(((unsigned long)sums / sizeof({T})) % 16), lo, cnt;  /* cut at sums' cache lines */
        deepx_share(cols + off, &lo, &cnt);
        long hi = lo + cnt - off;
        lo = lo > off ? lo - off : 0;
        for (long j = lo; j < hi; j++) sums[j] = ({T})0 + out[j];
        for (long r = 1; r < rows; r++) {{
            const {T} *orow = out + r * cols;
            IVDEP for (long j = lo; j < hi; j++) sums[j] = sums[j] + orow[j];
        }}"""
    else:
        split_body = f"""        if (rows >= k) fused_range(rows * t / k, rows * (t + 1) / k, 0, cols, cols, {args});
        else {{ long lo, cnt; deepx_share(cols, &lo, &cnt); fused_range(0, rows, lo, lo + cnt, cols, {args}); }}"""
    split = f"""{_OMP_SHARE}
/* fused on MKL's OpenMP threads: each takes a range of rows (a flat loop: of its one row's columns) */
void pfused(long rows, long cols, const {T} **in, const {T} *c, {T} *out{extra}) {{
    _Pragma("omp parallel") {{
        long t = omp_get_thread_num(), k = omp_get_num_threads();
{split_body}
    }}
}}
""" if openmp else ""
    return f"""#include <math.h>
#include <string.h>
{_IVDEP}
static inline {T} deepx_max({T} a, {T} b) {{ return a != a ? a : (b != b ? b : (a > b ? a : b)); }}
static inline {T} deepx_min({T} a, {T} b) {{ return a != a ? a : (b != b ? b : (a < b ? a : b)); }}
static inline {T} deepx_neg({T} v) {{
    union {{ {T} f; {bits} i; }} u;
    u.f = v;
    u.i ^= ({bits})1 << (sizeof({T}) * 8 - 1);
    return u.f;
}}
/* rows [r0, r1), columns [j0, j1) of the output (cols to a row) */
static void fused_range(long r0, long r1, long j0, long j1, long cols, const {T} **in, const {T} *c, {T} *out{extra}) {{
{scalars}{pointers}{start}    for (long r = r0; r < r1; r++) {{
        {T} *orow = out + r * cols;
        IVDEP for (long j = j0; j < j1; j++) {{
            long i = r * cols + j;
{body}
            orow[j] = {root};{accumulate}
        }}
    }}
}}
void fused(long rows, long cols, const {T} **in, const {T} *c, {T} *out{extra}) {{
    fused_range(0, rows, 0, cols, cols, {args});
}}
{split}"""


def _layout(a: np.ndarray, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(layout, row length) of input `a` against the output's shape (numpy's broadcasting, dimensions aligned on the
    right), or None when a C loop cannot read it."""
    if not a.flags.c_contiguous:
        return None
    return _shape_layout(a.shape, shape)


def _shape_layout(dims: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
    """_layout of a C-contiguous input of shape `dims`."""
    if math.prod(dims) == 1:
        return SCALAR, 0
    while len(dims) > len(shape) and dims[0] == 1:
        dims = dims[1:]
    if len(dims) > len(shape):
        return None
    dims = (1,) * (len(shape) - len(dims)) + dims
    if dims == shape:
        return FULL, 0
    k = 0
    while dims[k] == 1:
        k += 1
    if dims[k:] == shape[k:]:  # ones, then the output's trailing dimensions: a row repeated
        return ROW, math.prod(dims)
    if dims[-1] == 1 and dims[:-1] == shape[:-1]:  # the output's leading dimensions, one column
        return COLUMN, shape[-1]
    return None


def fused(plan: Any, inputs: Sequence[np.ndarray], out: np.ndarray, sums: np.ndarray | None = None) -> bool:
    """out = the expression of `plan` (fused.compile_expr's) over inputs, by a generated C loop; False where the
    caller must use numpy (not float32/float64 of one dtype, a layout it cannot read, an overlap, an expression numpy
    does better, or not yet HOT). One loop serves every expression of the plan's structure: the numbers are passed
    in. sums: also out's sum over axis 0 (a 2-D out; sums C-contiguous, of its columns and dtype, apart from every
    other array), in numpy's order, on one thread; False where that cannot be done, nothing written then."""
    dt = out.dtype
    n = out.size
    if (n < BROADCAST_MIN or dt not in CTYPE or not _enabled or not out.flags.c_contiguous
            or not out.flags.writeable):
        return False
    if sums is not None and (out.ndim != 2 or out.shape[1] < 2 or sums.dtype != dt or sums.size != out.shape[1]
                             or not sums.flags.c_contiguous or not sums.flags.writeable
                             or (_parts(n) > 1 and _omp() is None)):
        return False
    shape = out.shape
    layouts: list[int] = []
    cols = 0
    for a in inputs:
        if a.dtype != dt:
            return False
        found = _layout(a, shape)
        if found is None:
            return False
        layouts.append(found[0])
        if found[0] in (ROW, COLUMN):
            if cols and found[1] != cols:
                return False
            cols = found[1]
    if not cols and n < FUSED_MIN and sums is None:  # numpy's tape runs flat operands faster than a call here
        return False  # (not with the sums: numpy's are another pass, after the tape's, which the loop saves)
    key = (plan.text, len(inputs), CTYPE[dt], tuple(layouts), sums is not None)
    fn = _fused_fns.get(key)
    if fn is None:
        seen = _seen.get(key, 0) + 1
        if seen < HOT:
            _seen.put(key, seen)
            return False
        if _background:  # numpy this time, and until the compiler is done
            _build_in_background(key)
            return False
        fn = _build_fused(key)
    if fn is False:
        return False
    # an output that shares memory with an input must be that input, read at the same index (FULL)
    lo = _address(out)
    hi = lo + out.nbytes
    where = [_address(a) for a in inputs]
    for a, at, layout in zip(inputs, where, layouts):
        if at < hi and lo < at + a.nbytes and not (layout == FULL and at == lo):
            return False
    if sums is not None:
        s_lo = _address(sums)
        s_hi = s_lo + sums.nbytes
        if (s_lo < hi and lo < s_hi) or any(at < s_hi and s_lo < at + a.nbytes for a, at in zip(inputs, where)):
            return False
        rows, cols = out.shape
        split = _fused_split.get(key) if n >= OMP_MIN and _split_on else None
        (split or fn)(rows, cols, (ctypes.c_void_p * len(where))(*where), _consts_of(plan, dt), lo, s_lo)
        return True
    cs = _consts_of(plan, dt)
    if n >= OMP_MIN and _split_on:
        split = _fused_split.get(key)
        if split is not None:  # on MKL's OpenMP threads
            split(n // cols if cols else 1, cols or n, (ctypes.c_void_p * len(where))(*where), cs, lo)
            return True
    item = dt.itemsize
    if not cols:  # every input the output's shape or one element: one flat row, split into ranges across threads
        pieces = _pieces(n)
        if len(pieces) == 1:
            fn(1, n, (ctypes.c_void_p * len(where))(*where), cs, lo)
            return True
        starts = [(p0, p1 - p0) for p0, p1 in pieces]
        row = 1
    else:  # split the rows
        rows = n // cols
        parts = min(_parts(n), rows)
        if parts < 2:
            fn(rows, cols, (ctypes.c_void_p * len(where))(*where), cs, lo)
            return True
        edges = [rows * k // parts for k in range(parts + 1)]
        starts = [(edges[k] * cols, (edges[k + 1] - edges[k])) for k in range(parts)]
        row = cols
    from deepxd.kernels.cpu.fused import _threads

    def piece(start: int, count: int) -> None:  # count rows of `row` elements from element `start`
        moved = [at + start * item if layout == FULL else at + start // row * item if layout == COLUMN else at
                 for at, layout in zip(where, layouts)]
        if row == 1:
            fn(1, count, (ctypes.c_void_p * len(moved))(*moved), cs, lo + start * item)
        else:
            fn(count, row, (ctypes.c_void_p * len(moved))(*moved), cs, lo + start * item)

    futures = [_threads().submit(piece, start, count) for start, count in starts[1:]]
    piece(*starts[0])
    for f in futures:
        f.result()
    return True


def fused_call(plan: Any, shapes: Sequence[tuple[int, ...]], dt: np.dtype, shape: tuple[int, ...],
               with_sums: bool = False) -> Callable[..., bool]:
    """`fused` for one instruction of a program that runs again and again: inputs of these shapes and dtype `dt`, an
    output of `shape` (and its column sums, with_sums). What depends on the shapes alone (the layouts, the kernel,
    its constants) is found once; each call checks that the arrays are those shapes, C-contiguous and apart, then
    calls the loop. Until the kernel is compiled, and where the general path would split the loop on Python's
    threads, it is `fused` itself. Inside a training step a call costs about a third of fused's."""
    dt = np.dtype(dt)
    n = math.prod(shape)

    def never(inputs: Sequence[np.ndarray], out: np.ndarray, sums: np.ndarray | None = None) -> bool:
        return False

    if (n < BROADCAST_MIN or dt not in CTYPE or (with_sums and (len(shape) != 2 or shape[1] < 2))):
        return never
    layouts: list[int] = []
    sizes: list[int] = []
    cols = 0
    for s in shapes:
        found = _shape_layout(tuple(s), shape)
        if found is None:
            return never
        layouts.append(found[0])
        sizes.append(math.prod(s) * dt.itemsize)
        if found[0] in (ROW, COLUMN):
            if cols and found[1] != cols:
                return never
            cols = found[1]
    if not cols and n < FUSED_MIN and not with_sums:  # (as fused's)
        return never
    key = (plan.text, len(shapes), CTYPE[dt], tuple(layouts), with_sums)
    shapes = [tuple(s) for s in shapes]
    nbytes = n * dt.itemsize
    rows, width = (shape[0], shape[1]) if with_sums else ((n // cols, cols) if cols else (1, n))
    state: list[Any] = [None, None, 0, None]  # the loop, its split form, the constants' address, their array
    count = len(shapes)
    pointers = ctypes.c_void_p * count
    general = fused

    def call(inputs: Sequence[np.ndarray], out: np.ndarray, sums: np.ndarray | None = None) -> bool:
        fn = state[0]
        if fn is None:
            fn = _fused_fns.get(key)
            if fn is None or not _enabled:
                return general(plan, inputs, out, sums)  # counts the runs towards HOT, and compiles
            if fn is False:
                return False
            # the constants' array held here: _consts may be cleared (4096 entries) while this call lives
            state[0], state[1], state[3] = fn, _fused_split.get(key), _consts_array(plan, dt)
            state[2] = _address(state[3])
        split = state[1] if n >= OMP_MIN and _split_on else None
        if not _enabled or (split is None and n >= 2 * THREAD_MIN and MAX_THREADS > 1):
            return general(plan, inputs, out, sums)
        try:
            lo = _addressof(_CHAR.from_buffer(out))  # type: ignore[arg-type]  # C-contiguous and writable
        except (TypeError, ValueError):
            return False
        if out.dtype != dt or out.shape != shape:
            return False
        if len(inputs) != count:
            return False
        hi = lo + nbytes
        where = []
        for a, want, size, layout in zip(inputs, shapes, sizes, layouts):
            if a.shape != want or a.dtype != dt:
                return False
            try:
                at = _addressof(_CHAR.from_buffer(a))  # type: ignore[arg-type]
            except (TypeError, ValueError):  # read-only, or strided
                if not a.flags.c_contiguous:
                    return False
                at = a.__array_interface__["data"][0]
            if at < hi and lo < at + size and not (layout == FULL and at == lo):
                return False  # an output that shares memory with an input must be that input, read at its index
            where.append(at)
        if with_sums:
            if sums is None or sums.dtype != dt or sums.shape != (width,):
                return False
            try:
                s_lo = _addressof(_CHAR.from_buffer(sums))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                return False
            s_hi = s_lo + width * dt.itemsize
            if (s_lo < hi and lo < s_hi) or any(at < s_hi and s_lo < at + size for at, size in zip(where, sizes)):
                return False
            (split or fn)(rows, width, pointers(*where), state[2], lo, s_lo)
        else:
            (split or fn)(rows, width, pointers(*where), state[2], lo)
        return True

    return call


def _consts_array(plan: Any, dt: np.dtype) -> np.ndarray:
    """plan's constants as an array of dtype dt (made once: rounded as numpy rounds them)."""
    ck = (plan.text, plan.constants, dt)
    consts = _consts.get(ck)
    if consts is None:
        consts = _consts.put(ck, np.array(plan.constants or (0.0,), dt))
    return consts


def _consts_of(plan: Any, dt: np.dtype) -> int:
    """The address of plan's constants (_consts_array), for a call made now."""
    return _address(_consts_array(plan, dt))


def _build_in_background(key: tuple[str, int, str, tuple[int, ...], bool]) -> None:
    """Start compiling key's kernel on a daemon thread, unless that has started already (an exit does not wait for
    it: a hung compiler is killed by its timeout or with the process)."""
    with _building_lock:
        if key in _building or key in _fused_fns:
            return

        def build() -> None:
            try:
                _build_fused(key)
            except Exception:  # never seen: _build_fused keeps False for a kernel that cannot be had
                log.exception("native kernels: building a fused kernel failed; it runs on numpy")
                _fused_fns.put(key, False)
            finally:
                with _building_lock:
                    _building.pop(key, None)

        t = _building[key] = threading.Thread(target=build, name="deepx-native-build", daemon=True)
        try:
            t.start()
        except RuntimeError:  # no thread to be had (a limit on threads, an interpreter shutting down): numpy goes on
            del _building[key]


def _build_fused(key: tuple[str, int, str, tuple[int, ...], bool]) -> Any:
    """The compiled kernel of key, or False (kept, so that it is not tried again) when it has none."""
    text, _, ctype, layouts, colsum = key
    tree = ast.parse(text, mode="eval")  # ast.unparse of a checked tree
    omp = _omp() is not None
    lib = None
    if omp:
        source = fused_source(tree, ctype, layouts, colsum, openmp=True)
        lib = load(source, openmp=True) if source is not None else None
    if lib is None:  # without MKL, or its OpenMP build failed (logged): the serial loop alone
        omp = False
        source = fused_source(tree, ctype, layouts, colsum)
        lib = load(source) if source is not None else None
    if lib is None:
        if source is not None and not available():  # turned off meanwhile: not this kernel's failure, not kept
            return False
        _fused_fns.put(key, False)
        return False
    fn = lib.fused
    fn.argtypes, fn.restype = [_LONG, _LONG, ctypes.POINTER(ctypes.c_void_p), _PTR, _PTR, *[_PTR] * colsum], None
    if omp:
        split = lib.pfused
        split.argtypes, split.restype = fn.argtypes, None
        _fused_split.put(key, split)
    _fused_fns.put(key, fn)
    return fn
