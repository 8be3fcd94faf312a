"""CUDA C shared by every kernel module: storage and compute types per dtype, conversions, the strided indexer, block
reductions and a Philox counter-based generator.

Each family module builds its source as `HEADER + <its kernels>`, with one `extern "C"` kernel per (op, dtype) made
from C++ templates, so the kernels have plain names that `get_function` finds.
"""

from __future__ import annotations

from collections.abc import Sequence

#: dims an indexer handles after adjacent dims are merged; more falls back to the CPU kernel
MAXD = 8

#: deepx dtype -> (C storage type, C compute type)
CTYPES: dict[str, tuple[str, str]] = {
    "float64": ("double", "double"),
    "float32": ("float", "float"),
    "float16": ("__half", "float"),
    "bfloat16": ("__nv_bfloat16", "float"),
    "float8e5m2": ("__nv_fp8_e5m2", "float"),
    "float8e4m3": ("__nv_fp8_e4m3", "float"),
    "int64": ("long long", "long long"),
    "int32": ("int", "long long"),
    "int16": ("short", "long long"),
    "int8": ("signed char", "long long"),
    "bool": ("bool", "long long"),
}

FLOAT_TYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
INT_TYPES = frozenset({"int64", "int32", "int16", "int8"})

#: storage type of each item size, for kernels that only move bytes
BYTES_TYPE = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


def ctype(dtype: str) -> str:
    return CTYPES[dtype][0]


def acctype(dtype: str) -> str:
    return CTYPES[dtype][1]


def dims_format(n: int = 1) -> str:
    """The prepared-call format of `n` Dims structs (8 int64 each, 8-byte aligned like the C struct)."""
    return f"{MAXD}q" * n


def dims(values: Sequence[int]) -> list[int]:
    """A Dims argument: the values padded to MAXD."""
    return [int(v) for v in values] + [0] * (MAXD - len(values))


#: below this many elements an indexer divides by magic numbers (32-bit arithmetic; see FOR_COORDS)
NARROW_LIMIT = 1 << 31


def divisors(shape: Sequence[int], n: int) -> list[int]:
    """The `div` Dims of FOR_COORDS for a row-major `shape` of n elements: per dim, magic | shift << 32 such that
    q = (umulhi(r, magic) + r) >> shift is r // size for every r < 2^31 (torch's IntDivider); zeros when n reaches
    2^31 (the kernel divides in 64 bits)."""
    if n >= NARROW_LIMIT or any(s >= NARROW_LIMIT for s in shape):
        return [0] * MAXD
    out = []
    for size in shape:
        shift = max(0, (int(size) - 1).bit_length())
        magic = ((1 << 32) * ((1 << shift) - size)) // size + 1
        out.append(magic | shift << 32)
    return dims(out)


HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
// NVRTC has no C library headers: the limits and INFINITY the kernels use, defined for both compilers
#ifndef LLONG_MAX
#define LLONG_MAX 9223372036854775807LL
#endif
#ifndef LLONG_MIN
#define LLONG_MIN (-LLONG_MAX - 1LL)
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef long long ll;
typedef unsigned long long ull;
#define MAXD 8
struct Dims { ll v[MAXD]; };

// compute type: floats of 16 bits or less compute in float, integers and bool in long long
template <class T> struct Acc { typedef T type; };
template <> struct Acc<__half> { typedef float type; };
template <> struct Acc<__nv_bfloat16> { typedef float type; };
template <> struct Acc<__nv_fp8_e4m3> { typedef float type; };
template <> struct Acc<__nv_fp8_e5m2> { typedef float type; };
template <> struct Acc<int> { typedef ll type; };
template <> struct Acc<short> { typedef ll type; };
template <> struct Acc<signed char> { typedef ll type; };
template <> struct Acc<bool> { typedef ll type; };

template <class T> __device__ __forceinline__ typename Acc<T>::type ld(T x) { return (typename Acc<T>::type)x; }
template <> __device__ __forceinline__ float ld<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float ld<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float ld<__nv_fp8_e4m3>(__nv_fp8_e4m3 x) { return (float)x; }
template <> __device__ __forceinline__ float ld<__nv_fp8_e5m2>(__nv_fp8_e5m2 x) { return (float)x; }

// the widest type of a value's kind: double for floats, long long for integers and bool
template <class T> struct Wide { typedef ll type; };
template <> struct Wide<double> { typedef double type; };
template <> struct Wide<float> { typedef double type; };
template <> struct Wide<__half> { typedef double type; };
template <> struct Wide<__nv_bfloat16> { typedef double type; };
template <> struct Wide<__nv_fp8_e4m3> { typedef double type; };
template <> struct Wide<__nv_fp8_e5m2> { typedef double type; };
template <class T> __device__ __forceinline__ typename Wide<T>::type wide(T x) {
    return (typename Wide<T>::type)ld(x);
}

// store a computed value into a storage type (C conversion rules: round to nearest, truncate to integer)
template <class T> struct St {
    template <class V> static __device__ __forceinline__ T from(V v) { return (T)v; }
};
template <> struct St<bool> {
    template <class V> static __device__ __forceinline__ bool from(V v) { return v != (V)0; }
};
template <> struct St<__half> {
    static __device__ __forceinline__ __half from(float v) { return __float2half_rn(v); }
    static __device__ __forceinline__ __half from(double v) { return __double2half(v); }
    static __device__ __forceinline__ __half from(ll v) { return __ll2half_rn(v); }
};
template <> struct St<__nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
    static __device__ __forceinline__ __nv_bfloat16 from(double v) { return __double2bfloat16(v); }
    static __device__ __forceinline__ __nv_bfloat16 from(ll v) { return __ll2bfloat16_rn(v); }
};
template <> struct St<__nv_fp8_e4m3> {
    static __device__ __forceinline__ __nv_fp8_e4m3 from(float v) { return __nv_fp8_e4m3(v); }
    static __device__ __forceinline__ __nv_fp8_e4m3 from(double v) { return __nv_fp8_e4m3(v); }
    static __device__ __forceinline__ __nv_fp8_e4m3 from(ll v) { return __nv_fp8_e4m3((double)v); }
};
template <> struct St<__nv_fp8_e5m2> {
    static __device__ __forceinline__ __nv_fp8_e5m2 from(float v) { return __nv_fp8_e5m2(v); }
    static __device__ __forceinline__ __nv_fp8_e5m2 from(double v) { return __nv_fp8_e5m2(v); }
    static __device__ __forceinline__ __nv_fp8_e5m2 from(ll v) { return __nv_fp8_e5m2((double)v); }
};
template <class T, class V> __device__ __forceinline__ T st(V v) { return St<T>::from(v); }

// maximum and minimum that propagate nan (numpy's maximum/minimum)
template <class A> __device__ __forceinline__ A mx(A a, A b) { return (a != a || a > b) ? a : b; }
template <class A> __device__ __forceinline__ A mn(A a, A b) { return (a != a || a < b) ? a : b; }
// Python's (and torch's) float % and //, from the exact fmod: the remainder takes b's sign, the quotient is
// (a - fmod(a, b)) / b stepped down where the remainder was moved, then rounded to the nearest whole number
template <class A> __device__ __forceinline__ A pyrem(A a, A b) {
    const A r = fmod(a, b);
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
template <class A> __device__ __forceinline__ A pyfloordiv(A a, A b) {
    if (b == 0) return a / b;
    const A r = fmod(a, b);
    A d = (a - r) / b;
    if (r != 0 && ((r < 0) != (b < 0))) d -= 1;
    if (d == 0) return copysign((A)0, a / b);
    const A f = floor(d);
    return d - f > (A)0.5 ? f + 1 : f;
}
__device__ __forceinline__ ll ipow(ll b, ll e) {
    ll r = 1;
    while (e > 0) { if (e & 1) r *= b; b *= b; e >>= 1; }
    return r;
}

// The indexers' loops over dims run over MAXD with constant indices, skipping d >= nd: a Dims argument indexed by a
// runtime d is copied to every thread's stack in local memory (64 bytes a Dims), which cost a strided copy most of
// its time.

// the offset of linear index i of a row-major `shape` in a tensor with element strides `st`
__device__ __forceinline__ ll offset_of(ll i, int nd, const Dims& shape, const Dims& st) {
    ll off = 0;
    #pragma unroll
    for (int d = MAXD - 1; d >= 0; --d) {
        if (d < nd) {
            const ll s = shape.v[d], q = i / s;
            off += (i - q * s) * st.v[d];
            i = q;
        }
    }
    return off;
}

// BODY (the macro's last arguments) for each dim d of a row-major `shape` of nd dims, innermost first, with k the
// coordinate of linear index i along d. `div` holds each dim's division by a magic number (divisors() on the host:
// a multiply-high, an add and a shift instead of a 64-bit division's ~70 instructions), or zeros where an index may
// reach 2^31, which then divides in 64 bits.
#define FOR_COORDS(i, nd, shape, div, ...)                                                                  \
    if ((div).v[0] != 0) {                                                                                  \
        unsigned r_ = (unsigned)(i);                                                                        \
        _Pragma("unroll") for (int d = MAXD - 1; d >= 0; --d) {                                             \
            if (d < (nd)) {                                                                                 \
                const ull m_ = (ull)(div).v[d];                                                             \
                const unsigned q_ = (__umulhi(r_, (unsigned)m_) + r_) >> (unsigned)(m_ >> 32);              \
                const ll k = (ll)(r_ - q_ * (unsigned)(shape).v[d]);                                        \
                r_ = q_;                                                                                    \
                __VA_ARGS__                                                                                 \
            }                                                                                               \
        }                                                                                                   \
    } else {                                                                                                \
        ll r_ = (i);                                                                                        \
        _Pragma("unroll") for (int d = MAXD - 1; d >= 0; --d) {                                             \
            if (d < (nd)) {                                                                                 \
                const ll q_ = r_ / (shape).v[d], k = r_ - q_ * (shape).v[d];                                \
                r_ = q_;                                                                                    \
                __VA_ARGS__                                                                                 \
            }                                                                                               \
        }                                                                                                   \
    }

#define GRID_STRIDE(i, n) \
    for (ll i = (ll)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (ll)gridDim.x * blockDim.x)

template <class T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

// block-wide reductions (blockDim.x a multiple of 32, at most 1024); every thread gets the result
template <class A> __device__ __forceinline__ A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <class A> __device__ __forceinline__ A warp_prod(A v) {
    for (int o = 16; o > 0; o >>= 1) v *= __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <class A> __device__ __forceinline__ A warp_max(A v) {
    for (int o = 16; o > 0; o >>= 1) v = mx(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
template <class A> __device__ __forceinline__ A warp_min(A v) {
    for (int o = 16; o > 0; o >>= 1) v = mn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
#define BLOCK_REDUCE(NAME, WARP, IDENT)                                                     \
template <class A> __device__ A NAME(A v) {                                                 \
    __shared__ A part[32];                                                                  \
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;         \
    v = WARP(v);                                                                            \
    __syncthreads();                                                                        \
    if (lane == 0) part[w] = v;                                                             \
    __syncthreads();                                                                        \
    v = lane < nw ? part[lane] : (A)(IDENT);                                                \
    v = WARP(v);                                                                            \
    return v;                                                                               \
}
BLOCK_REDUCE(block_sum, warp_sum, 0)
BLOCK_REDUCE(block_prod, warp_prod, 1)

template <class A> __device__ A block_max(A v) {
    __shared__ A part[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    A first = part[0];
    v = lane < nw ? part[lane] : first;
    return warp_max(v);
}
template <class A> __device__ A block_min(A v) {
    __shared__ A part[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_min(v);
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    A first = part[0];
    v = lane < nw ? part[lane] : first;
    return warp_min(v);
}

// Philox4x32-10: four 32-bit random words from a 128-bit counter and a 64-bit key
struct U4 { unsigned int x, y, z, w; };
__device__ __forceinline__ U4 philox(ull ctr, ull key) {
    unsigned int c0 = (unsigned int)ctr, c1 = (unsigned int)(ctr >> 32), c2 = 0, c3 = 0;
    unsigned int k0 = (unsigned int)key, k1 = (unsigned int)(key >> 32);
    #pragma unroll
    for (int r = 0; r < 10; ++r) {
        unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    U4 r = {c0, c1, c2, c3};
    return r;
}
// a double uniform in [0, 1) from two words (53 random bits)
__device__ __forceinline__ double u01(unsigned int a, unsigned int b) {
    ull v = ((ull)a << 21) ^ (ull)b;
    return (double)(v & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0);
}
"""
