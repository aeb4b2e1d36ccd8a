"""The A/B harness (the README's first command): allocators compared on the same traces.

    python -m vmcache.bench [--mode sizing|compute|both] [--full] [--trace FILE] [--out DIR]

Sizing mode replays traces through each allocator's real bookkeeping at real model scale
(default Llama-3-8B, 16 GB of KV; ``--full``: 60 GB and 5× the requests) on the sizing backend,
which backs no bytes. Compute mode runs the engine with a small random model (see compute.py).
Prints tables beside the seed's claims, writes JSON and PNG plots under benchmarks/results.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..backends.sizing import SizingBackend
from ..cache import VMKVCache
from ..paged_fallback import PagedKVCache
from ..spec import KVSpec
from . import traces
from .allocators import CacheAlloc, OrcaAlloc, StaticAlloc
from .common import add_out_arg, save, table
from .report import CLAIMS, plot, verdicts
from .simulate import DoesNotFit, simulate

ALLOCATORS = ("static", "orca-256", "paged-8", "paged-16", "paged-32", "radix-paged-16",
              "vm-layer-2M", "vm-layer-64K", "vm-token-2M", "vm-token-64K",
              "radix-vm-layer-64K")  # fmt: skip
NUM_REQUESTS = {"enterprise": 200, "long": 40, "parallel": 80, "beam": 80, "shared": 120,
                "multiturn": 120}  # fmt: skip


def make_alloc(name: str, spec: KVSpec, budget: int, max_seqs: int):
    """One allocator by row name; ``radix-`` rows are the same cache with prefix caching."""
    bpt = spec.bytes_per_token
    prefix = name.startswith("radix-")
    name = name.removeprefix("radix-")
    if name == "static":
        return StaticAlloc(bpt, budget, traces.L_MAX)
    if name.startswith("orca"):
        return OrcaAlloc(bpt, budget, traces.L_MAX, int(name.split("-")[1]))
    if name.startswith("paged"):
        b = int(name.split("-")[1])
        kv = PagedKVCache(spec, pool_bytes=budget, block_size=b, device="meta",
                          max_seq_len=traces.L_MAX, max_seqs=max_seqs,
                          prefix_caching=prefix)  # fmt: skip
        return CacheAlloc(name, kv)
    if name.startswith("vm"):
        _, layout, size = name.split("-")
        page = (2 << 20) if size == "2M" else (64 << 10)
        kv = VMKVCache(spec, max_seqs, traces.L_MAX, backend=SizingBackend(granularity=page),
                       pool_bytes=budget, layout=f"{layout}_major",
                       prefix_caching=prefix)  # fmt: skip
        return CacheAlloc(name, kv)
    raise ValueError(f"unknown allocator {name!r}")


def progress(label: str):
    def show(done: int, total: int) -> None:
        bar = "#" * int(20 * done / max(total, 1))
        print(f"\r  {label:<28} [{bar:<20}] {done}/{total}", end="", file=sys.stderr, flush=True)

    return show


def run_sizing(args) -> list[dict]:
    spec = KVSpec.preset(args.model)
    budget = int(args.budget_gb * 1e9)
    scale = 5 if args.full else 1
    if args.trace:
        workloads = {args.trace: traces.read_csv(args.trace)}
    else:
        names = args.traces.split(",")
        workloads = {n: traces.builtin(n, NUM_REQUESTS[n] * scale, args.seed) for n in names}
    rows = []
    for tname, trace in workloads.items():
        base = None
        for aname in ALLOCATORS:
            alloc = make_alloc(aname, spec, budget, max_seqs=1024)
            row = {"trace": tname, "allocator": aname, "model": args.model,
                   "budget_GB": args.budget_gb, "requests": len(trace)}  # fmt: skip
            try:
                row.update(simulate(alloc, trace, args.seed, progress(f"{tname}/{aname}"),
                                    preemption=args.preemption))  # fmt: skip
            except DoesNotFit as exc:
                row["note"] = f"does not fit: {exc}"
            print(file=sys.stderr)
            if "steps" in row and aname == "static":
                base = row
            if "steps" in row and base is not None:
                row["concurrency_vs_static"] = row["tokens_per_step"] / base["tokens_per_step"]
            family = "radix" if aname.startswith("radix") else aname.split("-")[0]
            row["seed_claim"] = CLAIMS.get((tname, family), "")
            rows.append(row)
    verdicts(rows)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vmcache.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--mode", choices=("sizing", "compute", "both"), default="both")
    ap.add_argument("--model", default="llama-3-8b", help="KVSpec preset for sizing mode")
    ap.add_argument("--budget-gb", type=float, default=None, help="KV budget (default 16; 60 full)")
    ap.add_argument("--traces", default=",".join(traces.TRACES))
    ap.add_argument("--trace", help="CSV of prompt_len,output_len[,n][,arrival_s] rows")
    ap.add_argument("--full", action="store_true", help="60 GB budget, 5x the requests")
    ap.add_argument("--quick", action="store_true",
                    help="compute mode on fewer requests and budgets (the GPU check)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--tag", default="", help="suffix for the results' file names")
    ap.add_argument("--preemption", choices=("recompute", "swap"), default="recompute",
                    help="how sizing mode brings a preempted request back")  # fmt: skip
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if args.budget_gb is None:
        args.budget_gb = 60.0 if args.full else 16.0
    if args.trace:
        try:
            traces.read_csv(args.trace)
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
    dev = torch.device(args.device)
    sizing, comp = [], []
    if args.mode in ("sizing", "both"):
        print(f"== sizing mode: {args.model}, {args.budget_gb:g} GB KV budget, sizing backend "
              "(bookkeeping only, no bytes) ==")  # fmt: skip
        sizing = run_sizing(args)
        for tname in dict.fromkeys(r["trace"] for r in sizing):
            print(f"\n-- trace: {tname} --")
            print(table([r for r in sizing if r["trace"] == tname], [
                "allocator", "internal_waste_pct", "reservation_waste_pct", "waste_tokens_per_seq",
                "frag_stalls", "max_concurrent_seqs", "concurrency_vs_static", "cow_saving_pct",
                "preemptions", "prefill_tokens", "verdict"]))  # fmt: skip
    if args.mode in ("compute", "both"):
        print(f"\n== compute mode: engine + small random Llama on {dev} ==")
        # budgets: how many of the longest requests the VM cache holds at once (bytes)
        budgets = [4, 8] if args.quick else [4, 8, 16] if not args.full else [4, 8, 16, 32]
        num = 12 if args.quick else 32 if not args.full else 96
        from . import compute  # needs transformers (the bench extra)

        comp = compute.run(dev, num, budgets, progress("compute"))
        print(file=sys.stderr)
        print(table(comp, ["budget_requests", "cache", "tok_per_s", "step_ms", "map_ms_per_step",
                           "premap_ms_per_step", "max_running", "preempt_swap"]))  # fmt: skip
        num = 8 if args.quick else 24 if not args.full else 96
        print(f"\n-- radix rows, compute mode: {num} requests sharing a system prompt --")
        # a budget of a third of the requests: later admissions find the prompt cached (two
        # admitted in the same step both miss)
        radix = compute.run_prefix(dev, num, max(2, num // 3), progress("radix"))
        print(file=sys.stderr)
        print(table(radix, ["cache", "prefix_caching", "prefill_tokens", "prefix_hit_tokens",
                            "tok_per_s", "max_running"]))  # fmt: skip
        comp += [{"scenario": "shared_prompt", **r} for r in radix]
    name = "ab" + (f"-{args.tag}" if args.tag else "")
    rows = sizing + [{"mode": "compute", **r} for r in comp]
    path = save(name, dev, rows, {"args": vars(args)}, out_dir=args.out)
    print(f"\nsaved {path}")
    if not args.no_plot:
        for p in plot(sizing, comp, path):
            print(f"plot  {p}")


if __name__ == "__main__":
    main()
