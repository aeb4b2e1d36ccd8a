"""C entry points through which a compiled package calls the step's two operators
(``vmcache::packed_linear``, ``vmcache::step_attention``) without Python: AOTInductor's
``aot_inductor.custom_ops_to_c_shims`` (an official setting: a custom operator with a C shim is
called as ``aoti_torch_cpu_<name>(tensor handles, ints, doubles, &out)``) names the functions
below, and the package's library finds them in this one, loaded with its symbols global before
any package that calls them.

Without them, each call went from the package's C++ through torch's proxy executor (the
operator's arguments boxed on a stack, the dispatcher) into the operator's Python kernel and its
checks, then into the same C kernels through ``ctypes``: 5 calls a layer, on SmolLM2 (30
layers, an AMD EPYC's 2 cores) 160-210 µs a layer outside the kernels at one sequence.

    packed_linear    everything here: x of any strides (gathered once into rows where it is
                     not dense), the output allocated, :mod:`vmcache.kernels.cpu_gemm`'s kernel
    step_attention   a step whose every sequence brings at most SHORT_PREFILL new tokens
                     (decodes, a prompt's tail behind its cached prefix) on float32 K/V:
                     every index and length checked against the tensors' bounds, then
                     :mod:`vmcache.kernels.cpu_decode`'s kernel (the new K/V stored first, a
                     token of a prefill one query over its causal prefix of the rows); any
                     other step, and any argument the checks refuse, goes through the
                     dispatcher to the operator's own kernel (:mod:`vmcache.kernels.step_op`),
                     which plans it or raises why it refuses it

Both call the kernels the Python paths call, with the same sizes and thread count, so their
outputs are the Python paths' bit for bit (the tests check it). An error the shim itself
finds (packed_linear's arguments) is written to stderr, as torch's own shims write theirs, and
fails the package's run (``RuntimeError``); nothing is read or written out of bounds.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from vmcache.kernels import cpu_decode, cpu_gemm
from vmcache.kernels.cbuild import CFunction
from vmcache.kernels.step_op import SHORT_PREFILL

SOURCE = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* torch's C shim (torch/csrc/inductor/aoti_torch/c/shim.h): the calls used, as declared there */
typedef struct AtenTensorOpaque *AtenTensorHandle;
typedef int32_t AOTITorchError;
typedef uint64_t StableIValue;
extern AOTITorchError aoti_torch_get_data_ptr(AtenTensorHandle, void **);
extern AOTITorchError aoti_torch_get_dim(AtenTensorHandle, int64_t *);
extern AOTITorchError aoti_torch_get_sizes(AtenTensorHandle, int64_t **);
extern AOTITorchError aoti_torch_get_strides(AtenTensorHandle, int64_t **);
extern AOTITorchError aoti_torch_get_dtype(AtenTensorHandle, int32_t *);
extern AOTITorchError aoti_torch_get_device_type(AtenTensorHandle, int32_t *);
extern AOTITorchError aoti_torch_empty_strided(int64_t, const int64_t *, const int64_t *,
                                               int32_t, int32_t, int32_t, AtenTensorHandle *);
extern AOTITorchError aoti_torch_new_tensor_handle(AtenTensorHandle, AtenTensorHandle *);
extern AOTITorchError aoti_torch_delete_tensor_object(AtenTensorHandle);
extern AOTITorchError aoti_torch_call_dispatcher(const char *, const char *, StableIValue *);
extern int32_t aoti_torch_dtype_float32(void);
extern int32_t aoti_torch_dtype_int64(void);
extern int32_t aoti_torch_device_type_cpu(void);

typedef void (*linear_fn)(const float *, const float *, const float *, float *, int64_t,
                          int64_t, int64_t, int);
typedef void (*decode_fn)(const float *, float *, int64_t, int64_t, const int64_t *,
                          const int64_t *, float *, float *, float *, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float, int, const float *, const float *,
                          const int64_t *, int64_t, int64_t, int64_t);
#define MAXDIM 16
/* set once by vmcache_shims_init, before any package that calls the shims is loaded */
static linear_fn LINEAR;
static decode_fn DECODE;
static int64_t NB, SHORT, MIN_PART;

void vmcache_shims_init(void *linear, void *decode, int64_t nb, int64_t short_prefill,
                        int64_t min_part_rows) {
    LINEAR = (linear_fn)linear;
    DECODE = (decode_fn)decode;
    NB = nb;
    SHORT = short_prefill;
    MIN_PART = min_part_rows;
}

/* A tensor as the checks read it: dtype, device, sizes, strides, data. */
typedef struct { int64_t dim, *size, *stride; int32_t dtype, device; void *data; } T;

static int view(AtenTensorHandle h, T *t) {
    return aoti_torch_get_dim(h, &t->dim) || t->dim > MAXDIM
        || aoti_torch_get_sizes(h, &t->size) || aoti_torch_get_strides(h, &t->stride)
        || aoti_torch_get_dtype(h, &t->dtype) || aoti_torch_get_device_type(h, &t->device)
        || aoti_torch_get_data_ptr(h, &t->data);
}

static int64_t numel(const T *t) {
    int64_t n = 1;
    for (int64_t i = 0; i < t->dim; ++i) n *= t->size[i];
    return n;
}

/* row-major and dense (a dimension of size 1 may have any stride) */
static int dense(const T *t) {
    int64_t want = 1;
    for (int64_t i = t->dim - 1; i >= 0; --i) {
        if (t->size[i] != 1 && t->stride[i] != want) return 0;
        want *= t->size[i];
    }
    return 1;
}

static int is(const T *t, int32_t dtype, int64_t dim) {
    return t->dtype == dtype && t->device == aoti_torch_device_type_cpu() && t->dim == dim;
}

static AOTITorchError empty(int64_t dim, const int64_t *size, int32_t dtype,
                            AtenTensorHandle *out) {
    int64_t stride[MAXDIM], s = 1;
    for (int64_t i = dim - 1; i >= 0; --i) { stride[i] = s; s *= size[i]; }
    return aoti_torch_empty_strided(dim, size, stride, dtype, aoti_torch_device_type_cpu(), 0,
                                    out);
}

/* x's elements in row-major order into dst (x float32 of any strides) */
static void gather(const T *x, float *dst) {
    int64_t idx[MAXDIM] = {0}, n = numel(x);
    const float *src = x->data;
    for (int64_t e = 0; e < n; ++e) {
        int64_t off = 0;
        for (int64_t i = 0; i < x->dim; ++i) off += idx[i] * x->stride[i];
        dst[e] = src[off];
        for (int64_t i = x->dim - 1; i >= 0 && ++idx[i] == x->size[i]; --i) idx[i] = 0;
    }
}

static AOTITorchError refuse(const char *op, const char *why) {
    fprintf(stderr, "vmcache::%s in a compiled step: %s\n", op, why);
    return 1;
}

AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle packed,
                                            int64_t n, AtenTensorHandle *bias,
                                            AtenTensorHandle *ret0) {
    T xt, pt, bt;
    const int32_t f32 = aoti_torch_dtype_float32();
    if (!LINEAR || view(x, &xt) || view(packed, &pt) || (bias && view(*bias, &bt)))
        return refuse("packed_linear", "its arguments could not be read");
    if (xt.dtype != f32 || xt.device != aoti_torch_device_type_cpu() || xt.dim < 1)
        return refuse("packed_linear", "x must be a float32 CPU tensor of at least 1 dim");
    const int64_t k = xt.size[xt.dim - 1];
    if (!is(&pt, f32, 3) || !dense(&pt) || pt.size[1] != k || pt.size[2] != NB || k < 1
            || !((pt.size[0] - 1) * NB < n && n <= pt.size[0] * NB))
        return refuse("packed_linear", "packed is not the panels of an [n, K] weight");
    if (bias && (!is(&bt, f32, 1) || bt.size[0] != n || (n > 1 && bt.stride[0] != 1)))
        return refuse("packed_linear", "bias must be a contiguous float32 [n]");
    int64_t size[MAXDIM];
    memcpy(size, xt.size, xt.dim * sizeof(int64_t));
    size[xt.dim - 1] = n;
    AOTITorchError e = empty(xt.dim, size, f32, ret0);
    if (e) return e;
    const int64_t rows = numel(&xt) / k;
    if (rows == 0) return 0;
    float *rows_of = dense(&xt) ? NULL : malloc(rows * k * sizeof(float));
    if (!dense(&xt)) {
        if (!rows_of) {
            aoti_torch_delete_tensor_object(*ret0);
            return refuse("packed_linear", "out of memory");
        }
        gather(&xt, rows_of);
    }
    void *out;
    aoti_torch_get_data_ptr(*ret0, &out);
    LINEAR(rows_of ? rows_of : xt.data, pt.data, bias ? bt.data : NULL, out, rows, k, n,
           omp_get_max_threads());
    free(rows_of);
    return 0;
}

/* The operator's own kernel through the dispatcher (it plans any step, or raises why not). */
static AOTITorchError dispatch_attention(AtenTensorHandle *in, double scale,
                                         AtenTensorHandle *ret0) {
    StableIValue stack[9];
    for (int i = 0; i < 8; ++i) {
        AtenTensorHandle h;  /* a new reference: the dispatcher's stack takes it */
        if (aoti_torch_new_tensor_handle(in[i], &h)) {
            for (int j = 0; j < i; ++j) aoti_torch_delete_tensor_object((AtenTensorHandle)stack[j]);
            return 1;
        }
        stack[i] = (StableIValue)(uintptr_t)h;
    }
    memcpy(&stack[8], &scale, sizeof(double));
    AOTITorchError e = aoti_torch_call_dispatcher("vmcache::step_attention", "", stack);
    if (e == 0) *ret0 = (AtenTensorHandle)(uintptr_t)stack[0];
    return e;
}

/* Whether every index a query reads or a new row writes lies in [0, rows): 1 if so. */
static int in_rows(const int64_t *idx, int64_t n, int64_t rows) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= (uint64_t)idx[i] >= (uint64_t)rows;
    return !bad;
}

AOTITorchError aoti_torch_cpu_step_attention(AtenTensorHandle q, AtenTensorHandle k,
        AtenTensorHandle v, AtenTensorHandle store, AtenTensorHandle layout,
        AtenTensorHandle write, AtenTensorHandle read, AtenTensorHandle lens, double scale,
        AtenTensorHandle *ret0) {
    AtenTensorHandle in[8] = {q, k, v, store, layout, write, read, lens};
    T qt, kt, vt, st, lt, wt, rt, nt;
    const int32_t f32 = aoti_torch_dtype_float32(), i64 = aoti_torch_dtype_int64();
    /* anything but the kernel's case, or a check that fails: the operator's own kernel */
    if (!DECODE || view(q, &qt) || view(k, &kt) || view(v, &vt) || view(store, &st)
            || view(layout, &lt) || view(write, &wt) || view(read, &rt) || view(lens, &nt)
            || !is(&qt, f32, 3) || !is(&kt, f32, 2) || !is(&vt, f32, 2)
            || !is(&st, f32, 1) || !is(&lt, i64, 1) || lt.size[0] != 4 || !is(&wt, i64, 1)
            || !dense(&wt) || !is(&rt, i64, 2) || !dense(&rt) || !is(&nt, i64, 2)
            || !dense(&nt))
        return dispatch_attention(in, scale, ret0);
    const int64_t N = qt.size[0], HQ = qt.size[1], D = qt.size[2];
    const int64_t B = rt.size[0], S = rt.size[1], E = st.size[0];
    const int64_t *lay = lt.data, rows = lay[0], R = lay[lt.stride[0]];
    const int64_t k_at = lay[2 * lt.stride[0]], v_at = lay[3 * lt.stride[0]];
    const int64_t *q_lens = nt.data, *kv_lens = q_lens + B;
    if (N < 1 || B < 1 || S < 1 || D < 1 || R < D || R % D || HQ % (R / D) || nt.size[0] != 2
            || nt.size[1] != B || wt.size[0] != N || kt.size[0] != N || kt.size[1] != R
            || vt.size[0] != N || vt.size[1] != R || (R > 1 && (kt.stride[1] != 1
            || vt.stride[1] != 1)) || (E > 1 && st.stride[0] != 1) || rows < 1 || k_at < 0
            || v_at < 0 || rows > E / R || (k_at > v_at ? k_at : v_at) > E - rows * R)
        return dispatch_attention(in, scale, ret0);
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) {
        if (q_lens[b] < 1 || q_lens[b] > SHORT || kv_lens[b] < q_lens[b] || kv_lens[b] > S
                || !in_rows((const int64_t *)rt.data + b * S, kv_lens[b], rows))
            return dispatch_attention(in, scale, ret0);
        total += q_lens[b];
    }
    if (total != N || !in_rows(wt.data, N, rows)) return dispatch_attention(in, scale, ret0);
    /* a query per token: a decode reads its sequence's rows; token j of a prefill of n, the
       first kv_len - n + j + 1 of them (read copied a query, as step_op's _short plans) */
    const int64_t *qread = rt.data, *qlens = kv_lens;
    int64_t *made = NULL;
    if (N != B) {
        made = malloc(N * (S + 1) * sizeof(int64_t));
        if (!made) return refuse("step_attention", "out of memory");
        int64_t t = 0;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t j = 0; j < q_lens[b]; ++j, ++t) {
                memcpy(made + t * S, (const int64_t *)rt.data + b * S, S * sizeof(int64_t));
                made[N * S + t] = kv_lens[b] - q_lens[b] + j + 1;
            }
        qread = made;
        qlens = made + N * S;
    }
    const int threads = omp_get_max_threads();
    int64_t parts = (2 * threads + N - 1) / N;  /* as DecodeRows: every thread busy, parts */
    parts = parts < S / MIN_PART ? parts : S / MIN_PART;  /* of at least MIN_PART rows */
    parts = parts > 1 ? parts : 1;
    float *scratch = malloc(N * S * HQ * sizeof(float));
    float *partial = malloc(N * parts * HQ * (D + 2) * sizeof(float));
    float *qs = dense(&qt) ? NULL : malloc(N * HQ * D * sizeof(float));  /* q's rows, gathered */
    AOTITorchError e = scratch && partial && (qs || dense(&qt)) ? empty(3, qt.size, f32, ret0) : 1;
    if (e == 0) {
        void *out;
        aoti_torch_get_data_ptr(*ret0, &out);
        if (qs) gather(&qt, qs);
        DECODE(qs ? qs : qt.data, st.data, k_at, v_at, qread, qlens, out, scratch, partial, N,
               S, HQ, R / D, D, parts, (float)scale, threads, kt.data, vt.data, wt.data, N,
               kt.stride[0], vt.stride[0]);
    }
    free(scratch);
    free(partial);
    free(qs);
    free(made);
    return e ? refuse("step_attention", "out of memory") : 0;
}
"""

# the declarations inductor writes into a package that calls the shims (custom_ops_to_c_shims)
DECLARATIONS = {
    "packed_linear": "AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, "
    "AtenTensorHandle packed, int64_t n, AtenTensorHandle* bias, AtenTensorHandle* ret0)",
    "step_attention": "AOTITorchError aoti_torch_cpu_step_attention(AtenTensorHandle q, "
    "AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle store, AtenTensorHandle layout, "
    "AtenTensorHandle write, AtenTensorHandle read, AtenTensorHandle lens, double scale, "
    "AtenTensorHandle* ret0)",
}
_TORCH_LIB = Path(torch.__file__).parent / "lib"
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_INIT = CFunction(SOURCE, (), "vmcache_shims_init", [_ptr, _ptr, _i64, _i64, _i64],
                  libs=(f"-L{_TORCH_LIB}", "-ltorch_cpu", f"-Wl,-rpath,{_TORCH_LIB}"),
                  global_symbols=True)  # fmt: skip


class _Shims:
    """The library built, its kernels set, once a process (at the first :func:`available`)."""

    def __init__(self) -> None:
        self.state: tuple[bool, str] | None = None

    def available(self) -> tuple[bool, str]:
        if self.state is None:
            self.state = self._load()
        return self.state

    def _load(self) -> tuple[bool, str]:
        for name, (ok, why) in (("CPU GEMM", cpu_gemm.available()),
                                ("CPU decode kernel", cpu_decode.available())):  # fmt: skip
            if not ok:
                return False, f"no {name} ({why})"
        try:  # (a torch that exports a shim of one of these names would shadow ours)
            torch_cpu = ctypes.CDLL(str(_TORCH_LIB / "libtorch_cpu.so"))
        except OSError as e:
            return False, f"torch's libtorch_cpu could not be opened: {e}"
        taken = [n for n in DECLARATIONS if hasattr(torch_cpu, f"aoti_torch_cpu_{n}")]
        if taken:
            return False, f"torch exports C shims named {taken}"
        if _INIT.fn is None:
            return False, _INIT.reason
        _INIT.fn(cpu_gemm.address(), cpu_decode.address(), cpu_gemm.NB, SHORT_PREFILL,
                 cpu_decode.MIN_PART_ROWS)  # fmt: skip
        return True, ""


_SHIMS = _Shims()


def available() -> tuple[bool, str]:
    """(whether the shims are loaded here, why not): built and loaded at the first call. A
    package built to call them loads only in a process where this says True."""
    return _SHIMS.available()


def inductor_settings() -> dict:
    """inductor's settings that make a CPU package call the shims (none where they are not
    available here, or the package would not load)."""
    if not available()[0]:
        return {}
    ops = {torch.ops.vmcache.packed_linear.default: [DECLARATIONS["packed_linear"]],
           torch.ops.vmcache.step_attention.default: [DECLARATIONS["step_attention"]]}  # fmt: skip
    return {"aot_inductor.custom_ops_to_c_shims": ops}
