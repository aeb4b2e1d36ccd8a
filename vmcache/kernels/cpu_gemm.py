"""A linear layer on the CPU over weights packed once into panels: ``out = x · Wᵀ (+ bias)``,
float32, as the compiled step's GEMMs (``torch.ops.vmcache.packed_linear``).

Why: a decode step multiplies a few rows (one a sequence) by every weight of the model, so its
GEMMs read 4 bytes of weight for every 2·M flops; oneDNN's and MKL's fp32 GEMMs, which vLLM's
CPU build and inductor call, ran SmolLM2's decode GEMMs at 16 rows at 47 ms a step where its
424 MB of layer weights stream in 20 ms on this machine's 2 cores (an Intel Xeon, 2026-12-05).
This kernel streams each weight once a call, prefetching ahead, and keeps every row's sums in
registers:

    W [N, K] packed as panels of NB = 32 output columns, each column-block's K rows in order:

        packed [P, K, NB]    P = ⌈N / NB⌉ (the last panel's missing columns zero)
        packed[p, k, j] = W[p·NB + j, k]

    task (p, m-block of MC rows) → out[rows, p·NB : p·NB + NB]; the tasks run in parallel,
    a panel's m-blocks one after another (the panel stays in L2 while they go by):
        for k-chunks of KC (a task's rows under WHOLE_K; from it on, all of K at once):
            for 8 rows at a time:  acc[8][NB] += x[m, k] · packed[p, k, :]   (FMAs, registers)
                                   (the panel's chunk stays in L1 across the rows)
            or, from 6 rows a task on where the CPU has no AVX-512, for 6 rows at a time and
            each half of the panel: acc[6][16] (8 × 32 sums are 32 AVX2 registers of the 16
            there are: they spilled), the next chunk prefetched into L2 meanwhile.
            SmolLM2's 30 layers on an AMD EPYC's 2 cores (AVX2), 2026-12-06, tall blocks from
            32 rows: 64 rows 144 -> 122 ms, 300 rows 665 -> 418 ms (vLLM's oneDNN GEMM 114 and
            433 ms); 2026-12-07, from 6 rows with the L2 prefetch (layers and lm_head): 16 rows
            47 -> 35 ms, 64 rows 134 -> 112 ms, 1 to 4 rows unchanged (19 ms at 1 row).
            With AVX-512 the prefetch ran 4 KiB ahead into L1 (as measured on an Intel Xeon,
            2026-12-05) until an AMD EPYC with AVX-512 (2 cores, 2026-12-07) ran the layers'
            GEMMs alone 1.1-1.4x faster with the L2 prefetch from 5 rows on: 8 rows 16.2 ->
            12.8 ms, 16 rows 25.1-27.6 -> 18.0-20.1, 32 rows 51.3 -> 40.3, 64 rows 77.6 ->
            70.8, 1 to 4 rows level; not measured again on an Intel Xeon

A small C function compiled once a process (:mod:`vmcache.kernels.cbuild`); where no compiler
works, :func:`available` says why and the compiled step keeps inductor's GEMMs.
"""

from __future__ import annotations

import ctypes

import torch

from vmcache.kernels.cbuild import WIDE_VECTORS, CFunction

NB = 32  # output columns a panel (2 AVX-512 registers a row)
F32 = torch.float32
LAYOUT = f"panels-{NB}"  # the packed layout's name: a compiled step keys on it

SOURCE = r"""
#include <stdint.h>
#define NB 32
#define KC 128  /* a decode's k-chunk (the panel's chunk in L1 while its rows go by) */
#define MC 64
/* From TALL rows on, blocks of 6 rows by half a panel (16 columns): 12 sums, 2 columns of
   the panel and a row's value in 16 AVX2 registers, where 8 rows by 32 columns spill them.
   With AVX-512's 32 registers 8 by 32 fit: never (-DTALL=n sets it: the tests take 1).
   From WHOLE_K rows a task on, a panel's k runs in one chunk (the sums stay in registers).
   The prefetch runs AHEAD floats along the weights into the cache level LOCALITY names
   (2: L2): a whole k-chunk ahead, so the next chunk streams in while this one's row blocks
   go by, with AVX-512 or without (measured: the module's docstring). */
#define AHEAD (KC * NB)
#define LOCALITY 2
#ifdef __AVX512F__
#define WHOLE_K (MC + 1)
#ifndef TALL
#define TALL 0
#endif
#else
#define WHOLE_K 32
#ifndef TALL
#define TALL 6
#endif
#endif

/* acc[mb][jw] over k in [k0, k1) of rows x[0..mb) and columns [0, jw) of the panel from w
   (a row of it every NB floats); starts from out unless k0 = 0; nn of the jw are real */
static inline __attribute__((always_inline)) void block(const float *x, const float *w,
        float *out, int64_t N, int64_t K, int64_t k0, int64_t k1, int64_t n0, int64_t nn,
        const int mb, const int jw) {
    float acc[8][NB];
    for (int m = 0; m < mb; ++m)
        if (k0 == 0 || nn < jw)  /* (a narrow last panel: its missing columns stay 0) */
            for (int j = 0; j < jw; ++j) acc[m][j] = k0 == 0 || j >= nn ? 0.f : out[m * N + n0 + j];
        else
            #pragma omp simd
            for (int j = 0; j < jw; ++j) acc[m][j] = out[m * N + n0 + j];
    for (int64_t k = k0; k < k1; ++k) {
        const float *wk = w + k * NB;
        __builtin_prefetch(wk + AHEAD, 0, LOCALITY);
        if (jw > 16) __builtin_prefetch(wk + AHEAD + 16, 0, LOCALITY);
        for (int m = 0; m < mb; ++m) {
            const float xv = x[m * K + k];
            #pragma omp simd
            for (int j = 0; j < jw; ++j) acc[m][j] += xv * wk[j];
        }
    }
    for (int m = 0; m < mb; ++m)
        if (nn >= jw)
            #pragma omp simd
            for (int j = 0; j < jw; ++j) out[m * N + n0 + j] = acc[m][j];
        else
            for (int j = 0; j < nn; ++j) out[m * N + n0 + j] = acc[m][j];
}

/* rows [m0, hi) of a panel's k-chunk, r rows at a time (the row count a constant in each):
   8 rows by the whole panel, or (tall) 6 rows by each half of it */
#define BLOCK(r, jw) block(x + m * K, w + j0, out + m * N, N, K, k0, k1, n0 + j0, nj, r, jw)
static __attribute__((noinline)) void rows_of(const float *x, const float *w, float *out,
        int64_t N, int64_t K, int64_t k0, int64_t k1, int64_t n0, int64_t nn, int64_t m0,
        int64_t hi) {
    const int64_t j0 = 0, nj = nn;
    for (int64_t m = m0; m < hi; m += 8)
        switch (hi - m < 8 ? hi - m : 8) {
        case 1: BLOCK(1, NB); break;
        case 2: BLOCK(2, NB); break;
        case 3: BLOCK(3, NB); break;
        case 4: BLOCK(4, NB); break;
        case 5: BLOCK(5, NB); break;
        case 6: BLOCK(6, NB); break;
        case 7: BLOCK(7, NB); break;
        default: BLOCK(8, NB); break;
        }
}

static __attribute__((noinline)) void tall_rows_of(const float *x, const float *w, float *out,
        int64_t N, int64_t K, int64_t k0, int64_t k1, int64_t n0, int64_t nn, int64_t m0,
        int64_t hi) {
    for (int64_t m = m0; m < hi; m += 6)
        for (int64_t j0 = 0; j0 < nn; j0 += 16) {
            const int64_t nj = nn - j0;
            switch (hi - m < 6 ? hi - m : 6) {
            case 1: BLOCK(1, 16); break;
            case 2: BLOCK(2, 16); break;
            case 3: BLOCK(3, 16); break;
            case 4: BLOCK(4, 16); break;
            case 5: BLOCK(5, 16); break;
            default: BLOCK(6, 16); break;
            }
        }
}

void vmcache_linear(const float *x, const float *packed, const float *bias, float *out,
                    int64_t M, int64_t K, int64_t N, int threads) {
    const int64_t P = (N + NB - 1) / NB, MBLK = (M + MC - 1) / MC;
    const int64_t kc = M >= WHOLE_K ? K : KC;  /* many rows: the panel in L2, sums in registers */
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < P * MBLK; ++t) {
        const int64_t p = t / MBLK, lo = (t % MBLK) * MC, hi = lo + MC < M ? lo + MC : M;
        const float *w = packed + p * K * NB;
        const int64_t n0 = p * NB, nn = N - n0 < NB ? N - n0 : NB;
        for (int64_t k0 = 0; k0 < K; k0 += kc)
            (TALL && hi - lo >= TALL ? tall_rows_of : rows_of)(
                x, w, out, N, K, k0, k0 + kc < K ? k0 + kc : K, n0, nn, lo, hi);
        if (bias)
            for (int64_t m = lo; m < hi; ++m)
                for (int64_t j = 0; j < nn; ++j) out[m * N + n0 + j] += bias[n0 + j];
    }
}
"""

# x, packed, bias, out, M, K, N, threads; built on first use
_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
_KERNEL = CFunction(SOURCE, WIDE_VECTORS, "vmcache_linear", _ARGS)


def available() -> tuple[bool, str]:
    """(whether the compiled kernel runs here, why not)."""
    return _KERNEL.available()


def address() -> int | None:
    """The compiled kernel's C address (None where it is not available): for the package's C
    entry point (:mod:`vmcache.kernels.aoti_shims`), which calls it as the operator does."""
    fn = _KERNEL.fn
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight float32 ``[N, K]`` (a linear layer's) → packed float32 ``[P, K, NB]`` (module
    docstring), a new contiguous tensor."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise TypeError(f"pack takes a 2-D float32 CPU weight, not {weight.dtype} "
                        f"{list(weight.shape)} on {weight.device}")  # fmt: skip
    n, k = weight.shape
    if n < 1 or k < 1:
        raise ValueError(f"pack takes a weight of at least one row and column, not {[n, k]}")
    panels = -(-n // NB)
    padded = torch.zeros(panels * NB, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(panels, NB, k).transpose(1, 2).contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x float32 ``[..., K]``, packed float32 ``[P, K, NB]`` from :func:`pack` of an
    ``[n, K]`` weight, bias float32 ``[n]`` or None → float32 ``[..., n]``.

    Called once a linear layer a step: the checks are one test (its failure is explained by
    :func:`_refuse`), the output allocated in its final shape."""
    fn = _KERNEL.fn
    shape, ps = x.shape, packed.shape
    k = shape[-1] if shape else -1
    if (fn is None or x.dtype is not F32 or packed.dtype is not F32 or not x.is_cpu
            or len(ps) != 3 or ps[1] != k or ps[2] != NB or not (ps[0] - 1) * NB < n <= ps[0] * NB
            or not packed.is_contiguous()
            or (bias is not None and (bias.dtype is not F32 or bias.shape != (n,)))):  # fmt: skip
        _refuse(x, packed, n, bias)
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty((*shape[:-1], n), dtype=F32)
    rows = x.numel() // k
    if rows:
        b = None if bias is None else bias.contiguous()  # (kept alive through the call)
        fn(x.data_ptr(), packed.data_ptr(), None if b is None else b.data_ptr(),
           out.data_ptr(), rows, k, n, torch.get_num_threads())  # fmt: skip
    return out


def _refuse(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> None:
    """Why :func:`packed_linear` refuses these arguments, raised."""
    if _KERNEL.fn is None:
        raise RuntimeError(f"the CPU linear kernel is not available: {_KERNEL.reason}")
    if x.dtype != F32 or packed.dtype != F32 or not x.is_cpu:
        raise TypeError(f"packed_linear takes float32 CPU tensors, not {x.dtype} on {x.device}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != F32):
        raise ValueError(f"bias must be float32 [{n}], not {bias.dtype} {list(bias.shape)}")
    width = x.shape[-1] if x.dim() else None
    raise ValueError(f"packed {list(packed.shape)} is not an [{n}, {width}] weight's panels "
                     "(contiguous, from pack)")  # fmt: skip


# The operator a compiled graph calls (a torch.library.Library kernel, as step_attention's).
_OPS = torch.library.Library("vmcache", "FRAGMENT")  # kept: the registration lives with it
_OPS.define("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor")
_OPS.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("vmcache::packed_linear", lib=_OPS)
def _(x, packed, n, bias):
    return x.new_empty(*x.shape[:-1], n)
