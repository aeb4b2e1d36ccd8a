"""Decode attention on the CPU that reads each sequence's K/V rows where they lie: one pass
over K, one over V, nothing gathered or copied (the torch paths gather the history into a
padded ``[B, span, N_KV, d_h]`` copy, or run SDPA at a third of the read bandwidth on this
shape). A small C function, compiled once a process (:mod:`vmcache.kernels.cbuild`) and called
through ``ctypes``; where no compiler works, :func:`available` says why and callers keep their
torch path.

    store  float32 [E]: K rows at ``k_at + r·R``, V rows at ``v_at + r·R`` (R = N_KV · d_h)
    read   int64 [B, S]: the row of sequence b's position j; kv_len[b] of them are read

    sequence b's positions split into C parts (as many as keep every thread busy, at least
    MIN_PART_ROWS rows each); the tasks (b, c) run in parallel, each over whole rows in order:

        pass 1   s[hq, j] = scale · q[b, hq] · K[read[b, j], hq / G]    j in part c
        pass 2   m_c = max_j s,  p = exp(s − m_c),  l_c = Σ_j p            per query head
        pass 3   o_c = Σ_j p[hq, j] · V[read[b, j], hq / G]
        merge    out[b, hq] = Σ_c e^(m_c − M) o_c / Σ_c e^(m_c − M) l_c,  M = max_c m_c

A row is read whole (all N_KV heads, 768 B on SmolLM2), once: the step's K/V bytes stream
from memory once, as a decode's roofline counts them (a task per head reading a third of
each row ran at a fifth of the bandwidth here). Heads of VW·NV floats (d_h a multiple of VW
up to 128; 64 and 128 compiled with their loops unrolled) go in VW-float vectors (VW 16 with
AVX-512, else 8: AVX2's registers): pass 1 takes VW rows at a time and adds up their VW dot
products in one tree of shuffles (not one horizontal sum per row and head), pass 3 keeps a
head's output in registers across 32 rows. On SmolLM2's shape at 4,096 tokens (batch 4, 30
layers, 2 threads of an Intel Xeon, 2026-12-05) that took the layers' attention from 65 to
55 ms, the K/V streaming in 40 ms at this machine's read rate; the per-row code before it (a
horizontal sum and an integer division per row and head) ran at 11.5 GB/s. On an AMD EPYC's
2 cores (AVX2, 2026-12-06) the 16-wide vectors spilled and gcc broke their shuffles into
single floats: 4 GB/s; 8 wide, 14-27 GB/s (batch 64 of 320 tokens: 225 -> 66 ms a step).
"""

from __future__ import annotations

import ctypes

import torch

from vmcache.kernels.cbuild import CFunction

SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <float.h>
#include <string.h>

/* VW floats as one value: 16 (an AVX-512 register) where the CPU has AVX-512, else 8 (an
   AVX2 register: 16 floats as two of them spilled the 16 there are, and gcc broke the 16-wide
   shuffles into single floats: 4 GB/s on an AMD EPYC). vfu reads and writes them at any
   float's address and may alias floats (as the intrinsics' own unaligned types do). */
#ifndef VW  /* (-DVW=8 or 16 sets it: the tests build both) */
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
#endif
#define MAXNV (128 / VW)  /* vectors in the widest head taken (d_h 128) */
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
#define LD(p) (*(const vfu *)(p))
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* The lane sums of a[0..VW) as one vector, in VW - 1 shuffle-adds (not VW horizontal sums):
   each level halves the lanes a vector spends on one input and doubles its inputs,

       a[i]: VW lanes of input i → VW/2 of i, VW/2 of i+1 → ... → 1 of VW

   lane l of the result sums a[REV[l]], REV reversing l's bits (a wrong entry fails the
   tests' comparison with SDPA). */
#if VW == 16
static const int REV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
static inline __attribute__((always_inline)) vf sums(vf *a) {
    #pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
        const vf x = a[2 * i], y = a[2 * i + 1];
        a[i] = SHUF(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUF(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    #pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
        const vf x = a[2 * i], y = a[2 * i + 1];
        a[i] = SHUF(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + SHUF(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
    #pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
        const vf x = a[2 * i], y = a[2 * i + 1];
        a[i] = SHUF(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + SHUF(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
    return SHUF(a[0], a[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + SHUF(a[0], a[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
#else
static const int REV[8] = {0, 4, 2, 6, 1, 5, 3, 7};
static inline __attribute__((always_inline)) vf sums(vf *a) {
    #pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
        const vf x = a[2 * i], y = a[2 * i + 1];
        a[i] = SHUF(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
    }
    #pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
        const vf x = a[2 * i], y = a[2 * i + 1];
        a[i] = SHUF(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    }
    return SHUF(a[0], a[1], 0, 8, 2, 10, 4, 12, 6, 14)
         + SHUF(a[0], a[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
#endif

/* s[0..VW) = scale · q · K[rows[jj]] for VW rows, one query head (its K head at kbase +
   row·R; NV vectors a head): row jj's products summed into one vector, put where sums
   returns it as lane jj. */
static inline __attribute__((always_inline)) void dots(const float *qh, const float *kbase,
        const int64_t *rows, int64_t R, float *s, float scale, const int NV) {
    vf q[MAXNV], a[VW];
    #pragma GCC unroll 16
    for (int t = 0; t < NV; ++t) q[t] = LD(qh + VW * t);
    #pragma GCC unroll 16
    for (int jj = 0; jj < VW; ++jj) {
        const float *k = kbase + rows[jj] * R;
        vf acc = q[0] * LD(k);
        #pragma GCC unroll 16
        for (int t = 1; t < NV; ++t) acc += q[t] * LD(k + VW * t);
        a[REV[jj]] = acc;
    }
    *(vfu *)s = sums(a) * scale;
}

/* o[0 .. VW·NV) += Σ_jj p[jj] · V[rows[jj]] over nr rows, one query head: the sums in
   registers across the rows. */
static inline __attribute__((always_inline)) void axpys(float *o, const float *p,
        const float *vbase, const int64_t *rows, int64_t R, int64_t nr, const int NV) {
    vf acc[MAXNV];
    #pragma GCC unroll 16
    for (int t = 0; t < NV; ++t) acc[t] = LD(o + VW * t);
    for (int64_t jj = 0; jj < nr; ++jj) {
        const float *v = vbase + rows[jj] * R;
        const float pj = p[jj];
        #pragma GCC unroll 16
        for (int t = 0; t < NV; ++t) acc[t] += pj * LD(v + VW * t);
    }
    #pragma GCC unroll 16
    for (int t = 0; t < NV; ++t) *(vfu *)(o + VW * t) = acc[t];
}

/* Sequence b's rows [lo, hi): unnormalized output o [HQ, D], and per query head its max
   score and sum of exponentials (ml [HQ, 2]); s: scratch [HQ, hi - lo]. Heads of VW·NV
   floats (up to 128) go in vectors, VW rows at a time for the scores (their K in L1 while
   every query head goes by) and 32 for the output; any other D, and the scores' last rows,
   one by one. */
static inline __attribute__((always_inline)) void part(
        const float *qb, const float *store, int64_t k_at, int64_t v_at, const int64_t *rows,
        int64_t lo, int64_t hi, float *s, float *o, float *ml, int64_t HQ, int64_t G,
        int64_t D, int64_t R, float scale) {
    const int64_t n = hi - lo;
    const int NV = D / VW, vec = D % VW == 0 && NV <= MAXNV;
    int32_t kvh[HQ];  /* query head → its K/V head (no division inside the loops) */
    for (int64_t hq = 0; hq < HQ; ++hq) kvh[hq] = (int32_t)(hq / G);
    int64_t j0 = 0;
    if (vec)
        for (; j0 + VW <= n; j0 += VW)
            for (int64_t hq = 0; hq < HQ; ++hq)
                dots(qb + hq * D, store + k_at + kvh[hq] * D, rows + lo + j0, R,
                       s + hq * n + j0, scale, NV);
    for (int64_t j = j0; j < n; ++j) {
        const float *k = store + k_at + rows[lo + j] * R;
        for (int64_t hq = 0; hq < HQ; ++hq) {
            const float *qh = qb + hq * D, *kh = k + kvh[hq] * D;
            float acc = 0.f;
            #pragma omp simd reduction(+:acc)
            for (int64_t d = 0; d < D; ++d) acc += qh[d] * kh[d];
            s[hq * n + j] = acc * scale;
        }
    }
    for (int64_t hq = 0; hq < HQ; ++hq) {
        float *sh = s + hq * n, m = sh[0], sum = 0.f;
        for (int64_t j = 1; j < n; ++j) m = sh[j] > m ? sh[j] : m;
        for (int64_t j = 0; j < n; ++j) { sh[j] = expf(sh[j] - m); sum += sh[j]; }
        ml[2 * hq] = m;
        ml[2 * hq + 1] = sum;
        for (int64_t d = 0; d < D; ++d) o[hq * D + d] = 0.f;
    }
    if (vec) {
        for (j0 = 0; j0 < n; j0 += 32)
            for (int64_t hq = 0; hq < HQ; ++hq)
                axpys(o + hq * D, s + hq * n + j0, store + v_at + kvh[hq] * D, rows + lo + j0,
                      R, n - j0 < 32 ? n - j0 : 32, NV);
        return;
    }
    for (int64_t j = 0; j < n; ++j) {
        const float *v = store + v_at + rows[lo + j] * R;
        for (int64_t hq = 0; hq < HQ; ++hq) {
            const float p = s[hq * n + j], *vh = v + kvh[hq] * D;
            float *oh = o + hq * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) oh[d] += p * vh[d];
        }
    }
}

/* The step's new K/V rows stored (n_new of them, row write[i], k_new's and v_new's rows
   k_ld and v_ld floats apart; none where n_new is 0), then every sequence's rows split into
   C parts run in parallel, then merged per sequence. */
void vmcache_decode(const float *q, float *store, int64_t k_at, int64_t v_at,
                    const int64_t *read, const int64_t *lens, float *out, float *scratch,
                    float *partial, int64_t B, int64_t S, int64_t HQ, int64_t HKV, int64_t D,
                    int64_t C, float scale, int threads, const float *k_new,
                    const float *v_new, const int64_t *write, int64_t n_new, int64_t k_ld,
                    int64_t v_ld) {
    const int64_t G = HQ / HKV, R = HKV * D;
    for (int64_t i = 0; i < n_new; ++i) {
        memcpy(store + k_at + write[i] * R, k_new + i * k_ld, R * sizeof(float));
        memcpy(store + v_at + write[i] * R, v_new + i * v_ld, R * sizeof(float));
    }
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < B * C; ++task) {
        const int64_t b = task / C, c = task % C, n = lens[b];
        const int64_t step = (n + C - 1) / C, lo = c * step, hi = lo + step < n ? lo + step : n;
        float *o = partial + task * HQ * (D + 2), *ml = o + HQ * D;
        if (lo >= hi) {  /* an empty part: weight 0 in the merge */
            for (int64_t hq = 0; hq < HQ; ++hq) { ml[2 * hq] = -FLT_MAX; ml[2 * hq + 1] = 0.f; }
            continue;
        }
        const float *qb = q + b * HQ * D;
        float *s = scratch + (b * S + lo) * HQ;
        const int64_t *rows = read + b * S;
        if (D == 64)
            part(qb, store, k_at, v_at, rows, lo, hi, s, o, ml, HQ, G, 64, R, scale);
        else if (D == 128)
            part(qb, store, k_at, v_at, rows, lo, hi, s, o, ml, HQ, G, 128, R, scale);
        else
            part(qb, store, k_at, v_at, rows, lo, hi, s, o, ml, HQ, G, D, R, scale);
    }
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t hq = 0; hq < HQ; ++hq) {
            float m = -FLT_MAX, den = 0.f;
            for (int64_t c = 0; c < C; ++c) {
                const float mc = partial[((b * C + c) * HQ * (D + 2)) + HQ * D + 2 * hq];
                m = mc > m ? mc : m;
            }
            float *oh = out + (b * HQ + hq) * D;
            for (int64_t d = 0; d < D; ++d) oh[d] = 0.f;
            for (int64_t c = 0; c < C; ++c) {
                const float *o = partial + (b * C + c) * HQ * (D + 2), *ml = o + HQ * D;
                if (ml[2 * hq + 1] == 0.f) continue;
                const float w = expf(ml[2 * hq] - m);
                den += w * ml[2 * hq + 1];
                for (int64_t d = 0; d < D; ++d) oh[d] += w * o[hq * D + d];
            }
            const float inv = 1.f / den;
            for (int64_t d = 0; d < D; ++d) oh[d] *= inv;
        }
    }
}
"""

# -ffast-math: expf and the dot products vectorized (the scores are finite: no inf/NaN logic);
# -Wno-psabi: without AVX-512, gcc warns that a 64-byte vector's calling convention differs
# (the functions that take and return them are inlined), which would crowd out a real error
# in the reason a failed build reports
FLAGS = ("-ffast-math", "-Wno-psabi")
MIN_PART_ROWS = 256  # a sequence is split into parts of at least this many rows


_i64, _ptr = ctypes.c_int64, ctypes.c_void_p  # (vmcache_decode's arguments; built on first use)
KERNEL = CFunction(SOURCE, FLAGS, "vmcache_decode",
                   [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64,
                    _i64, _i64, ctypes.c_float, ctypes.c_int, _ptr, _ptr, _ptr, _i64, _i64,
                    _i64])  # fmt: skip


def available() -> tuple[bool, str]:
    """(whether the compiled kernel runs here, why not)."""
    return KERNEL.available()


def address() -> int | None:
    """The compiled kernel's C address (None where it is not available): for the package's C
    entry point (:mod:`vmcache.kernels.aoti_shims`), which calls it as
    :class:`~vmcache.kernels.cpu_decode_plan.DecodeRows` does."""
    fn = KERNEL.fn
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def serves(q: torch.Tensor, kv_dtype: torch.dtype) -> bool:
    """Whether :func:`~vmcache.kernels.cpu_decode_plan.decode_rows` takes these decodes
    (float32 queries and K/V on the CPU, the kernel built here) rather than a caller's gather
    and SDPA."""
    return (q.device.type == "cpu" and q.dtype == kv_dtype == torch.float32
            and available()[0])  # fmt: skip
