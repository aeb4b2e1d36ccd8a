"""Compile every Triton kernel of vmcache for the GPU (sm_90 by default) on a machine without
one, with exactly the arguments the library's own launch code passes, and record registers,
spills and shared memory per kernel (``ptxas -v``).

How: Triton's runtime asks its *active driver* for the device, the stream and the target.
A stand-in driver answers ``GPUTarget("cuda", 90, 32)`` (and nothing else: it cannot launch),
so ``kernel.warmup(...)`` specialises the arguments and compiles them through Triton's bundled
``ptxas`` exactly as a launch on an H200 would: the same constexprs, the same alignment
attributes. The arguments come from ``vmcache.kernels.triton_decode.launches`` and
``triton_prefill.launches`` called on real caches laid out as on the GPU (2 MiB pages, the
real layer counts) over the CPU host backend.

    TRITON_INTERPRET=0 python benchmarks/compile_sm90.py [--quick] [--arch 90] [--out DIR]

Must run in its own process with ``TRITON_INTERPRET`` unset or 0 (``@triton.jit`` reads it at
import time). Written against Triton 3.6 (the GPU image's); fails clearly if internals move.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_sm90.py needs TRITON_INTERPRET unset or 0 (it compiles, not interprets)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from vmcache import KVSpec, VMKVCache  # noqa: E402
from vmcache.kernels import triton_decode, triton_prefill  # noqa: E402
from vmcache.kernels.common import layer_window, packed_trees  # noqa: E402
from vmcache.kernels.plan import plan  # noqa: E402
from vmcache.memory.backends.host import HostBackend  # noqa: E402
from vmcache.memory.backends.strict import CUDA_GRANULARITY, StrictBackend  # noqa: E402
from vmcache.paged_fallback import PagedKVCache  # noqa: E402
from vmcache.paged_fallback.cache import layers_per_table  # noqa: E402

# name: (layers, kv heads, head_dim, q heads)
SHAPES = {
    "llama-3-8b": (32, 8, 128, 32),
    "llama-3.2-1b": (16, 8, 64, 32),
    "d96-mha": (32, 32, 96, 32),
    "d96-gqa": (32, 8, 96, 32),
    "gemma-2-9b": (42, 8, 256, 16),  # head_dim 256
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# quantized K/V (compute bf16, storage FP8 / INT8: loaded as bytes, dequantized in registers);
# "-token": per-token scales, read from each token's row (granularity "token")
KV_DTYPES = {"bf16/fp8e4m3": torch.float8_e4m3fn, "bf16/fp8e5m2": torch.float8_e5m2,
             "bf16/int8": torch.int8, "bf16/int8-token": torch.int8,
             "bf16/fp8e4m3-token": torch.float8_e4m3fn}  # fmt: skip
MODES = ("paged", "layer_major", "token_major")
QUICK = (
    [("llama-3-8b", "bf16", m) for m in MODES]
    + [("d96-gqa", "fp32", "token_major")]
    + [("llama-3-8b", "bf16/fp8e4m3", "paged"), ("d96-gqa", "bf16/int8", "layer_major")]
    + [("llama-3-8b", "bf16/int8-token", "token_major")]
)


class CompileOnlyDriver:
    """Triton's active driver for compiling: answers the target, cannot launch."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def __getattr__(self, name):
        raise RuntimeError(f"compile-only Triton driver: {name} is not available (no GPU)")


def build(mode: str, spec: KVSpec, max_len: int = 5000):
    """A cache laid out as on the GPU, two live sequences; returns (cache, seq_ids)."""
    if mode == "paged":
        tables = spec.num_layers // layers_per_table(spec)
        cache = PagedKVCache(spec, num_blocks=2 * tables * -(-max_len // 16), block_size=16,
                             max_seq_len=max_len, max_seqs=4)  # fmt: skip
    else:
        be = StrictBackend(HostBackend(), CUDA_GRANULARITY)
        cache = VMKVCache(spec, 4, max_len, backend=be, own_backend=True, layout=mode,
                          pool_bytes=12 * (2 * spec.num_layers) * CUDA_GRANULARITY)  # fmt: skip
    seqs = [cache.new_sequence() for _ in range(2)]
    for s in seqs:
        cache.grow(s, 17)
    return cache, seqs


def _views(cache, mode: str, p, layer: int):
    if mode == "paged":
        return (
            cache.views.k_pool(layer),
            cache.views.v_pool(layer),
            p.tables,
            cache.config.block_size,
        )
    return cache.views.k_cache(layer), cache.views.v_cache(layer), p.slots, 1


def decode_launches(cache, mode: str, seqs: list[int], layer: int = 0) -> list:
    """The kernel launches ``kernels.decode`` makes for ``seqs`` (one query each) at
    ``layer``: the library's own plan and launch code, nothing rebuilt here."""
    spec = cache.spec
    p = plan(cache, seqs, [1] * len(seqs), layer=layer)
    q = torch.zeros(len(seqs), spec.q_heads, spec.head_dim, dtype=spec.dtype)
    k, v, table, block = _views(cache, mode, p, layer)
    _, runs = triton_decode.launches(q, k, v, table, p.lens, max_len=p.max_kv,
                                     paged=mode == "paged", block=block,
                                     window=layer_window(cache, layer),
                                     kv_scales=cache.views.kv_scales_for(layer))  # fmt: skip
    return runs


def prefill_launches(cache, mode: str, seqs: list[int], layer: int = 0,
                     tree: bool = False) -> list:  # fmt: skip
    """The launch ``kernels.prefill(..., impl="triton")`` makes for ``seqs``, each bringing
    its last min(len, 5) tokens as queries; ``tree``: the first sequence's queries a token
    tree (two chains), as ``kernels.attend(masks=...)`` launches on CUDA."""
    spec = cache.spec
    q_lens = [min(cache.seq_len(s), 5) for s in seqs]
    masks = [None] * len(seqs)
    if tree:
        n = q_lens[0]
        masks[0] = torch.ones(n, n, dtype=torch.bool).tril()
        masks[0][n - 1, : n - 1] = False  # the last token: a second chain off the history
    flags, packed = packed_trees(masks)
    p = plan(cache, seqs, q_lens, layer=layer, trees=flags)
    q = torch.zeros(sum(q_lens), spec.q_heads, spec.head_dim, dtype=spec.dtype)
    k, v, table, block = _views(cache, mode, p, layer)
    _, runs = triton_prefill.launches(q, k, v, table, p.lens, p.starts, max_q=p.max_q,
                                      paged=mode == "paged", block=block,
                                      window=layer_window(cache, layer),
                                      kv_scales=cache.views.kv_scales_for(layer), tree_masks=packed,
                                      mask_starts=p.mask_starts)  # fmt: skip
    return runs


def ptxas_report(ptx: str, arch: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src, obj = os.path.join(d, "k.ptx"), os.path.join(d, "k.o")
        with open(src, "w") as f:
            f.write(ptx)
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        res = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm}", src, "-o", obj],
                             capture_output=True, text=True, check=True)  # fmt: skip
    text = res.stdout + res.stderr

    def num(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    return {"registers": num(r"Used (\d+) registers"),
            "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads")}  # fmt: skip


def compile_one(shape: str, dtype: str, mode: str, arch: int) -> list[dict]:
    layers, hk, d, hq = SHAPES[shape]
    kv, per_token = KV_DTYPES.get(dtype), dtype.endswith("-token")
    scales = None if kv is None or per_token else (1.0,) * (2 * layers * hk)
    spec = KVSpec(layers, hk, d, DTYPES[dtype.split("/")[0]], num_q_heads=hq, kv_dtype=kv,
                  kv_scales=scales, kv_granularity="token" if per_token else "head")  # fmt: skip
    cache, seqs = build(mode, spec)
    try:
        runs = decode_launches(cache, mode, seqs, 1) + prefill_launches(cache, mode, seqs, 1)
        runs += [(k, g, a, {**kw, "tree": True}) for k, g, a, kw in
                 prefill_launches(cache, mode, seqs, 1, tree=True)]  # fmt: skip
        rows = []
        for kernel, grid, args, kwargs in runs:
            kwargs = dict(kwargs)
            name = kernel.fn.__name__ + (" (tree)" if kwargs.pop("tree", False) else "")
            t0 = time.perf_counter()
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            rows.append({"kernel": name, "shape": shape, "dtype": dtype,
                         "mode": mode, "head_dim": d, "gqa_group": hq // hk, "arch": arch,
                         "shared_bytes": compiled.metadata.shared,
                         "num_warps": compiled.metadata.num_warps,
                         "compile_s": round(time.perf_counter() - t0, 2),
                         **ptxas_report(compiled.asm["ptx"], arch)})  # fmt: skip
        return rows
    finally:
        cache.close()


def compilations_over_growth(mode: str, arch: int = 90) -> dict:
    """Specialisations each kernel compiles while a batch decodes from 1 to 5,000 tokens
    (the partition count, the longest block table and the lengths all change) on a hybrid
    model, a sliding layer (W = 300, its pages released as it goes) and a full one: want 1
    (the window is a runtime argument)."""
    prev = driver._active
    driver.set_active(CompileOnlyDriver(arch))
    spec = KVSpec(2, 8, 128, torch.bfloat16, num_q_heads=32, layer_windows=(300, None))
    cache, seqs = build(mode, spec)
    try:
        kernels = [triton_decode._decode_partial, triton_decode._combine, triton_prefill._prefill]
        before = [len(k.device_caches[0][0]) for k in kernels]
        for n in (1, 15, 16, 17, 255, 1023, 1024, 1025, 2049, 4999):
            for s in seqs:
                cache.grow(s, n - cache.seq_len(s)) if n > cache.seq_len(s) else None
            for layer in (0, 1):
                batch = seqs[: 1 + n % 2]
                for kernel, grid, args, kwargs in decode_launches(
                    cache, mode, batch, layer
                ) + prefill_launches(cache, mode, batch, layer):
                    kernel.warmup(*args, grid=grid, **kwargs)
        return {k.fn.__name__: len(k.device_caches[0][0]) - b for k, b in zip(kernels, before)}
    finally:
        cache.close()
        driver._active = prev


def run(cases, arch: int = 90) -> list[dict]:
    prev = driver._active  # reset_active() would probe for a real GPU driver
    driver.set_active(CompileOnlyDriver(arch))
    try:
        return [row for case in cases for row in compile_one(*case, arch)]
    finally:
        driver._active = prev


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI subset (7 cases)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", default=None, help="write compile_sm<arch>.json here")
    ap.add_argument(
        "--growth",
        action="store_true",
        help="count compilations over a growing decode instead (prints JSON)",
    )
    args = ap.parse_args(argv)
    if args.growth:
        import json

        counts = {m: compilations_over_growth(m, args.arch) for m in MODES}
        print(json.dumps(counts))
        return counts
    cases = QUICK if args.quick else list(itertools.product(SHAPES, [*DTYPES, *KV_DTYPES],
                                                                  MODES))  # fmt: skip
    rows = run(cases, args.arch)
    for r in rows:
        print(f"{r['kernel']:16} {r['shape']:13} {r['dtype']:12} {r['mode']:12} "
              f"regs {r['registers']:3}  spills {r['spill_stores']:4}/{r['spill_loads']:4} B  "
              f"smem {r['shared_bytes']:6} B")  # fmt: skip
    if args.out:
        import json

        doc = {"triton": triton.__version__, "torch": torch.__version__, "arch": args.arch,
               "date": time.strftime("%Y-%m-%d"), "device": "compiled on CPU (no GPU), ptxas -v",
               "rows": rows}  # fmt: skip
        path = os.path.join(args.out, f"compile_sm{args.arch}.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
