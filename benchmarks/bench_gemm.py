"""The compiled CPU step's GEMMs alone: SmolLM2-135M's 30 layers of linear layers (q/k/v and
gate/up stacked as the step stacks them: [960, 576], [576, 576], [3072, 576], [576, 1536]),
each layer's weights its own (425 MB in all, streamed from memory as in a step), at a
decode's few rows and at a prefill's, by

    aten        torch.nn.functional.linear on the plain weights (MKL / oneDNN inside torch)
    onednn_mm   vLLM's CPU GEMM (vllm._custom_ops.onednn_mm on its packed handle), when vLLM
                imports here: run it with vLLM's venv (make bench-gemm does)
    vmcache     vmcache.kernels.cpu_gemm.packed_linear on weights packed once

Every kernel's repeats are rotated together (medians with min–max; seconds for all 30 layers).

    make bench-gemm        # in .venv-vllm, so vLLM's GEMM is in the same run
    python benchmarks/bench_gemm.py [--rows 2,8,16,32,612] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_speed import rotated
from common import add_out_arg, save

from vmcache.kernels import cpu_gemm

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [n, K] of one layer's GEMMs
LAYERS = 30


def kernels(weights: list) -> dict:
    """name → (x per shape → one pass over every layer's GEMMs)."""
    out = {"aten": lambda xs: [torch.nn.functional.linear(xs[i], w) for i, w in weights]}
    try:
        from vllm import _custom_ops as ops

        handles = [(i, ops.create_onednn_mm(w.t(), 32)) for i, w in weights]
        out["onednn_mm"] = lambda xs: [ops.onednn_mm(h, xs[i], None) for i, h in handles]
    except ImportError:
        pass
    packed = [(i, cpu_gemm.pack(w), w.shape[0]) for i, w in weights]
    out["vmcache"] = lambda xs: [cpu_gemm.packed_linear(xs[i], p, n) for i, p, n in packed]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="2,8,16,32,612")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if not cpu_gemm.available()[0]:
        raise SystemExit(f"vmcache's CPU GEMM is not available: {cpu_gemm.available()[1]}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [(i, torch.randn(*s, generator=g) * 0.02) for _ in range(LAYERS)
               for i, s in enumerate(SHAPES)]  # fmt: skip
    fns = kernels(weights)
    rows = []
    for m in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(m, k, generator=g) for _, k in SHAPES]
        want = fns["aten"](xs)
        for fn in fns.values():  # the same products, each kernel once before timing
            got = fn(xs)
            assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(got, want))
        times = {k: [] for k in fns}
        for rep in range(args.repeats):
            for k in rotated(fns, rep):
                t = time.perf_counter()
                fns[k](xs)
                times[k].append(time.perf_counter() - t)
        row = {"rows": m}
        for k, v in times.items():
            row[k] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
        rows.append(row)
        print(m, {k: f"{row[k]['median'] * 1e3:.1f} ms" for k in fns}, flush=True)
    extra = {"threads": args.threads, "repeats": args.repeats, "layers": LAYERS,
             "shapes": [list(s) for s in SHAPES], "kernels": list(fns),
             "weight_bytes": 4 * LAYERS * sum(n * k for n, k in SHAPES)}  # fmt: skip
    print(f"saved {save('gemm', torch.device('cpu'), rows, extra, Path(args.out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
