"""Messages and bytes per whole-sequence hand-off (vmcache.distributed.send_sequence), and
the wall time of one over torch.distributed, for VMKVCache (both layouts) and PagedKVCache
(one message per block per layer and K/V, or one packed copy per table).

    python benchmarks/bench_handoff.py [--quick] [--repeats 5]

SIZING, at real model scale: Llama-3-8B (32 layers, 8 KV heads, d_h 128, bf16), 2 MiB pages,
B = 16, prompts of 512 to 8,192 tokens. Counted on real caches over the host backend by the
hand-off's own plan (:func:`vmcache.distributed.plan_handoff`; nothing sent).

MEASURED: two processes joined by gloo on this machine (the loopback, CPU copies), a
Llama-3.2-1B-shaped cache (16 layers, 8 KV heads, d_h 64, bf16; 2 MiB pages, B = 16): one
sequence of random K/V sent from rank 0 to rank 1, which maps it and frees it; per point the
median of --repeats hand-offs (sender's time, from the header to the receiver's commit) with
min and max. On a GPU the same code runs over NCCL with one GPU per process; one GPU cannot
host both ranks (NCCL refuses two ranks on one device), so no GPU figure is reported here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import add_out_arg, save_and_plot, table

from vmcache import KVSpec, VMKVCache
from vmcache.distributed import plan_handoff, recv_sequence, send_sequence
from vmcache.memory.backends.host import HostBackend
from vmcache.paged_fallback import PagedKVCache

LENGTHS = (512, 1024, 2048, 4096, 8192)
VARIANTS = ("vm layer_major", "vm token_major", "paged per block", "paged packed")
PAGE, BLOCK = 2 << 20, 16


def make(variant: str, spec: KVSpec, length: int):
    if variant.startswith("paged"):
        return PagedKVCache(spec, num_blocks=-(-length // BLOCK), block_size=BLOCK,
                            max_seq_len=length, max_seqs=1)  # fmt: skip
    layout = variant.split()[1]
    return VMKVCache(spec, 1, length, page_size=PAGE, layout=layout, backend=HostBackend())


def sizing_rows() -> list[dict]:
    spec = KVSpec.preset("llama-3-8b", torch.bfloat16)
    rows = []
    for n in LENGTHS:
        for v in VARIANTS:
            with make(v, spec, n) as c:
                s = c.new_sequence()
                c.grow(s, n)
                msgs, nbytes = plan_handoff(c, s, packed=v == "paged packed")
            rows.append({"part": "sizing", "model": "llama-3-8b", "cache": v, "tokens": n,
                         "messages": msgs, "bytes": nbytes,
                         "mean_message_KiB": nbytes / msgs / 1024})  # fmt: skip
    return rows


def _fill(c, n: int, gen: torch.Generator) -> int:
    s = c.new_sequence()
    c.grow(s, n)
    shape = (n, c.spec.num_kv_heads, c.spec.head_dim)
    for layer in range(c.spec.num_layers):
        k = torch.randn(shape, generator=gen).to(c.spec.dtype)
        c.write(layer, s, 0, k, k)
    return s


def _rank(rank: int, init: str, lengths, repeats: int, queue) -> None:
    torch.set_num_threads(1)  # two processes on two cores (OMP_NUM_THREADS is read at import)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    spec = KVSpec.preset("llama-3.2-1b", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in lengths:
        for v in VARIANTS:
            packed = v == "paged packed"
            with make(v, spec, n) as c:
                s = _fill(c, n, gen) if rank == 0 else None
                times = []
                for _ in range(repeats + 1):  # the first is a warm-up
                    if rank == 0:
                        times.append(send_sequence(c, s, 1, packed=packed).seconds)
                    else:
                        c.free(recv_sequence(c, 0).slot)
                dist.barrier()
                if rank == 0:
                    msgs, nbytes = plan_handoff(c, s, packed)
                    t = times[1:]
                    rows.append({"part": "measured", "model": "llama-3.2-1b", "cache": v,
                                 "tokens": n, "messages": msgs, "bytes": nbytes,
                                 "median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t),
                                 "max_ms": 1e3 * max(t), "repeats": repeats,
                                 "GB_per_s": nbytes / statistics.median(t) / 1e9})  # fmt: skip
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def measured_rows(lengths, repeats: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'rendezvous')}"
        procs = [ctx.Process(target=_rank, args=(r, init, lengths, repeats, queue))
                 for r in range(2)]  # fmt: skip
        for p in procs:
            p.start()
        rows = queue.get(timeout=1800)
        for p in procs:
            p.join()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="512 and 2,048 tokens, 2 repeats")
    ap.add_argument("--repeats", type=int, default=5)
    add_out_arg(ap)
    args = ap.parse_args(argv)
    lengths = (512, 2048) if args.quick else LENGTHS
    rows = sizing_rows() + measured_rows(lengths, 2 if args.quick else args.repeats)
    cols = ["part", "cache", "tokens", "messages", "bytes", "median_ms", "min_ms", "max_ms"]
    print(table(rows, cols))
    extra = {"page_bytes": PAGE, "block_size": BLOCK, "transport": "gloo (loopback, CPU)"}
    save_and_plot("handoff", torch.device("cpu"), rows, extra, args.out, plot)
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for v in VARIANTS:
        pts = [
            (r["tokens"], r["messages"]) for r in rows if r["part"] == "sizing" and r["cache"] == v
        ]
        axes[0].plot(*zip(*pts), "-o", label=v, ms=4)
        pts = [
            (r["tokens"], r["median_ms"])
            for r in rows
            if r["part"] == "measured" and r["cache"] == v
        ]
        axes[1].plot(*zip(*pts), "-o", label=v, ms=4)
    axes[0].set_title("messages per hand-off, Llama-3-8B")
    axes[1].set_title("hand-off time over gloo (this CPU), Llama-3.2-1B")
    for ax, label in zip(axes, ("messages", "ms (median)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
