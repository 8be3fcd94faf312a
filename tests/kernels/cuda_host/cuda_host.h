// CUDA's thread model on host threads, for running a kernel module's CUDA C (without the shared header) on a machine
// with no GPU: a block at a time, one std::thread per CUDA thread, std::barrier for __syncthreads and __syncwarp, a
// per-warp exchange buffer for __shfl_xor_sync, dynamic shared memory a global array (`smem`). It checks the index
// arithmetic, the masking and the synchronisation of a kernel, never its speed. Float and double compute types.
#pragma once
#include <barrier>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif
typedef long long ll;
typedef unsigned long long ull;
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
thread_local Dim3 threadIdx;
Dim3 blockIdx, blockDim, gridDim;
static std::barrier<>* block_barrier;
static std::barrier<>* warp_barrier[32];
static double exchange[32][32];
extern "C" { alignas(16) unsigned char smem[1 << 22]; }

inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { warp_barrier[threadIdx.x >> 5]->arrive_and_wait(); }
template <class V> V __shfl_xor_sync(unsigned, V v, int o) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    exchange[w][lane] = (double)v;
    warp_barrier[w]->arrive_and_wait();
    const V r = (V)exchange[w][lane ^ o];
    warp_barrier[w]->arrive_and_wait();
    return r;
}
using std::exp;
using std::log;
// what the kernels use of deepxd/kernels/cuda/_src.py's HEADER, for float and double
template <class T> struct Acc { typedef T type; };
template <class T> inline T ld(T x) { return x; }
template <class T, class V> inline T st(V v) { return (T)v; }
template <class A> inline A mx(A a, A b) { return (a != a || a > b) ? a : b; }
template <class A> inline A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <class A> inline A warp_max(A v) {
    for (int o = 16; o > 0; o >>= 1) v = mx(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// run f() as grid (gx, gy) of blocks of nt threads
template <class F> void launch(unsigned gx, unsigned gy, unsigned nt, F f) {
    gridDim = {gx, gy, 1};
    blockDim = {nt, 1, 1};
    std::barrier<> block(nt);
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (unsigned w = 0; w < nt / 32; ++w) {
        warps.emplace_back(new std::barrier<>(32));
        warp_barrier[w] = warps.back().get();
    }
    block_barrier = &block;
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {
            blockIdx = {x, y, 0};
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < nt; ++t) threads.emplace_back([t, &f] { threadIdx = {t, 0, 0}; f(); });
            for (auto& t : threads) t.join();
        }
}
