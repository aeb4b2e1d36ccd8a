"""The A/B harness (the README's first command): allocators compared on the same traces.

    python -m vmcache.bench [--mode sizing|compute|both] [options]

SIZING MODE replays request traces through each allocator's real bookkeeping at real model
scale (default Llama-3-8B, 16 GB of KV) on the sizing backend, which backs no bytes: page
tables, refcounts, copy-on-write and the prefix index run for real, no model does. Time is
modelled (vmcache.bench.latency.StepModel: per-step, per-prompt-token, per-sequence and
K/V-read costs of an 8B model on an H100-class GPU), so its latencies are modelled seconds.
By default: six capacity traces queued at t = 0 (sized so memory binds), then the heavy-
tailed trace arriving open-loop (Poisson) at each of --rates.

COMPUTE MODE runs the engine with a small random Llama (transformers) over VMKVCache and
PagedKVCache at several KV budgets and at --compute-rates requests/s: measured tokens/s and
TTFT / TPOT percentiles, median of --repeats runs with the spread (min–max). --kv-dtype fp8
(or fp8-token, int8-token) stores both caches' K/V quantized: run it beside auto to compare.

TRACES (--traces): enterprise, long, parallel (n = 4), beam (width 4), shared (2,000-token
system prompt), multiturn (4 turns), heavy (lognormal prompts <= 4k, outputs <= 3k); see
vmcache/bench/traces.py. Or --trace FILE: a CSV with a header naming prompt_len, output_len
and optionally n (samples) and arrival_s (seconds; rows are replayed in arrival order), e.g.

    prompt_len,output_len,n,arrival_s
    812,190,1,0.00
    95,1024,4,0.35

ALLOCATORS (--allocators, comma-separated; default all but the extras, radix rows only on the
shared and multiturn traces): static (L_max slots),
orca-256 (contiguous extents grown by 256 tokens), paged-8/16/32 (block tables, B tokens),
vm-layer-2M / vm-layer-64K (a virtual range per layer and K/V, 2 MiB or 64 KiB pages),
vm-token-2M (one range per K/V, all layers of a token together), radix-<cache> (prefix caching
on); extras: vm-token-64K, <cache>-copy (forks copy: the baseline sharing is measured against).

ELASTIC MODE (--mode elastic; make bench-elastic): two engines in two processes with
alternating bursts on one shared page budget against two static halves at 1x, 2x and 4x the
load that fits, and sleep/wake time (vmcache/bench/elastic.py). TIERS MODE (--mode tiers; make
bench-tiers): a multi-turn trace four times the device pool through prefix tiers in host RAM
and on disk (vmcache/bench/tiers.py). SPEC MODE (--mode spec; make bench-spec): speculative
decoding by prompt lookup against none, where drafts match and where they do not
(vmcache/bench/speculation.py). Each takes --quick, --repeats and --out here, and any other option
of its own is passed on (e.g. --mode elastic --loads 1).

CLAIMS: each row with a claim from the literature gets a verdict that can read DIFFERS (rules
in vmcache/bench/report.py: verdicts); a row where memory never bound says so instead of
quoting a capacity. Results: JSON (with commit, CPU, package versions) and PNG under --out;
scripts/render_readme.py turns committed JSON into docs/results.md's tables.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from vmcache.bench import sizing, traces
from vmcache.bench.common import add_out_arg, save, table
from vmcache.bench.report import plot, unique_prompt_tokens, verdicts
from vmcache.models import DEFAULT_MODEL

COLUMNS = ["allocator", "internal_waste_pct", "reservation_waste_pct", "seq_waste_max_tok",
           "frag_stalls", "max_concurrent_seqs", "cow_saving_pct", "preemptions",
           "recompute_tokens", "prefill_tokens", "bytes_copied", "verdict"]  # fmt: skip
RATE_COLUMNS = ["allocator", "rate_rps", "model_ttft_p50_s", "model_ttft_p99_s",
                "model_tpot_p50_s", "model_tpot_p99_s", "model_goodput_rps", "preemptions",
                "max_concurrent_seqs", "memory_binding"]  # fmt: skip


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def workloads(args) -> tuple[dict, dict]:
    """{(trace name, rate or None): requests} and {trace name: unique prompt tokens}."""
    out = {}
    if args.trace:
        trace, skipped = traces.read_csv(args.trace, args.l_max, args.skip_long)
        if skipped:
            print(f"{args.trace}: skipped {skipped} rows longer than --l-max {args.l_max}")
        trace = sizing.sample(trace, args.sample, args.seed)
        out[(args.trace, None)] = trace
        for rate in _floats(args.rates):
            out[(args.trace, rate)] = traces.with_rate(trace, rate, args.seed)
        return out, {}
    unique = {}
    for name in args.traces.split(","):
        n = sizing.NUM_REQUESTS[name] * args.scale
        trace = sizing.sample(traces.builtin(name, n, args.seed), args.sample, args.seed)
        if name == "heavy":
            for rate in _floats(args.rates):
                out[(name, rate)] = traces.with_rate(trace, rate, args.seed)
        else:
            out[(name, None)] = trace
        if name in ("shared", "multiturn"):
            unique[name] = unique_prompt_tokens(trace)
    return out, unique


def run_sizing(args) -> list[dict]:
    work, unique = workloads(args)
    names = args.allocators.split(",") if args.allocators else None  # None: the defaults
    for a in names or ():  # a typo fails here, before any work
        try:
            sizing.make_alloc(a, sizing.KVSpec.preset("llama-3-8b"), 1 << 30, max_seqs=1)
        except ValueError as exc:
            raise SystemExit(f"python -m vmcache.bench: error: {exc}") from None
    rows = sizing.run(work, names, args, args.jobs)
    verdicts(rows, unique)
    for (tname, rate), trace in work.items():
        rs = [r for r in rows if r["trace"] == tname and r["rate_rps"] == rate]
        when = f"Poisson {rate:g} req/s" if rate else "all queued at t = 0"
        print(f"\n-- trace: {tname} ({len(trace)} requests, {when}) --")
        print(table(rs, COLUMNS if rate is None else RATE_COLUMNS + ["internal_waste_pct"]))
    return rows


def run_compute(args, dev: torch.device) -> list[dict]:
    from vmcache.bench import compute  # needs transformers (the bench extra)

    print(f"\n== compute mode: engine + small random Llama on {dev} ==")
    rows = compute.run(dev, args.compute_requests, _floats(args.compute_rates),
                       [int(b) for b in _floats(args.budgets)], args.repeats,
                       sizing_progress("compute"), kv=args.kv_dtype)  # fmt: skip
    print(table(rows, ["cache", "budget_requests", "rate_rps", "tok_per_s", "ttft_p50_s",
                       "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "preempt_swap",
                       "spread_note"]))  # fmt: skip
    n = args.compute_requests
    print(f"\n-- radix rows, compute mode: {n} requests sharing a system prompt --")
    radix = compute.run_prefix(dev, n, max(2, n // 3), sizing_progress("radix"),
                               kv=args.kv_dtype)  # fmt: skip
    print(table(radix, ["cache", "prefix_caching", "prefill_tokens", "prefix_hit_tokens",
                        "prefix_waits", "tok_per_s", "max_running"]))  # fmt: skip
    rows = rows + [{"scenario": "shared_prompt", **r} for r in radix]
    from vmcache.bench import compute_real, real

    name = args.real_model
    if not real.available(name):
        print(f"\n(real-model rows skipped: {name} is not there; for the embedded model run "
              "`python -m vmcache.models fetch`)")  # fmt: skip
        return rows
    print(f"\n== compute mode on the trained model: {real.label(name)}, chat requests ==")
    n = min(args.real_requests, len(compute_real.QUESTIONS))
    new = 16 if args.quick else compute_real.NEW
    served = compute_real.run(_floats(args.compute_rates)[0], args.repeats, n, args.kv_dtype,
                              name, new)  # fmt: skip
    print(table(served, ["cache", "prefill", "rate_rps", "tok_per_s", "ttft_p50_s",
                         "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "spread_note"]))  # fmt: skip
    # (at least two behind the shared prompt: the second one's hit is the row's point)
    shared = compute_real.run_prefix(max(2, n), args.kv_dtype, name, new)
    print(table(shared, ["cache", "prefix_caching", "prompt_tokens", "prefill_tokens",
                         "prefix_hit_tokens", "tok_per_s"]))  # fmt: skip
    return rows + [{"real": True, **r} for r in served + shared]


def sizing_progress(label: str):
    def show(done: int, total: int) -> None:
        print(f"\r  {label}: {done}/{total} runs", end="" if done < total else "\n",
              file=sys.stderr, flush=True)  # fmt: skip

    return show


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vmcache.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--mode", choices=("sizing", "compute", "both", "elastic", "tiers", "spec",
                                       "quant"),
                    default="both")  # fmt: skip
    g = ap.add_argument_group("sizing mode")
    g.add_argument(
        "--model",
        default="llama-3-8b",
        help="KVSpec preset (llama-3-8b, -70b, ...); "
        "a :fp8, :fp8-token or :int8-token suffix stores K/V quantized",
    )
    g.add_argument("--budget-gb", type=float, default=16.0, help="KV budget in GB (16)")
    g.add_argument("--traces", default=",".join(traces.TRACES), help="built-in traces to run")
    g.add_argument("--trace", help="a CSV trace instead (format above)")
    g.add_argument("--rates", default="8,16,32",
                   help="Poisson rates, req/s, for heavy or --trace (8,16,32)")  # fmt: skip
    g.add_argument("--scale", type=int, default=1, help="multiply built-in trace sizes")
    g.add_argument("--sample", type=int, help="replay N requests drawn from the trace")
    g.add_argument("--allocators", help="comma-separated allocator names (see ALLOCATORS)")
    g.add_argument("--l-max", type=int, default=traces.L_MAX, help="max tokens per request")
    g.add_argument("--skip-long", action="store_true",
                   help="skip (and count) CSV rows longer than --l-max")  # fmt: skip
    g.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="tokens per step: decodes + prefill chunks (8192)")  # fmt: skip
    g.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    g.add_argument("--jobs", type=int, help="worker processes (default: every core)")
    c = ap.add_argument_group("compute mode")
    c.add_argument("--compute-requests", type=int, default=12)
    c.add_argument(
        "--compute-rates",
        default="4,32",
        help="arrival rates, req/s (4,32: a light and a saturating load)",
    )
    c.add_argument(
        "--real-requests",
        type=int,
        default=4,
        help="chat requests of the trained model's rows, at the first rate, and behind its "
        "shared system prompt (4)",
    )
    c.add_argument("--budgets", default="8", help="KV budgets, in longest requests held (8)")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--kv-dtype", default="auto",
                   choices=["auto", *(k for k in sizing.KV_STORAGES if k)],
                   help="K/V storage: the model's dtype (auto), or FP8 / INT8 (fp8: e4m3 with "
                   "head scales; -token: per-token scales)")  # fmt: skip
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small everything: 50 requests a trace, one rate, 4 compute requests, 2 chat "
        "requests of 16 new tokens on the trained model (both also behind its shared "
        "prompt), 1 repeat (a first look; CI, the GPU check)",
    )
    ap.add_argument("--real-model", default=DEFAULT_MODEL,
                    help="the trained chat model of the real-model rows (compute, spec, quant): "
                         "what vmcache.models.load takes, an embedded name, a checkpoint "
                         f"directory or a .gguf file (default {DEFAULT_MODEL})")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--tag", default="", help="suffix for the results' file names")
    add_out_arg(ap)
    return ap


def main(argv=None) -> None:
    ap = parser()
    args, rest = ap.parse_known_args(argv)
    if args.mode in ("elastic", "tiers", "spec", "quant"):  # their own workloads and files
        from vmcache.bench import elastic, quant, speculation, tiers

        # the options this parser does not know go to the mode's own (e.g. elastic --loads)
        fwd = ["--repeats", str(args.repeats)] + ["--quick"] * args.quick
        fwd += ["--real-model", args.real_model] if args.mode in ("spec", "quant") else []
        fwd += (["--out", args.out] if args.out else []) + rest
        {"elastic": elastic, "tiers": tiers, "spec": speculation, "quant": quant}[args.mode].main(
            fwd
        )
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.quick:  # a first look in well under a minute a mode on 2 cores
        args.compute_requests, args.repeats, args.compute_rates, args.budgets = 4, 1, "4", "4,8"
        args.real_requests = 2
        args.sample = args.sample or 50
        if args.rates == ap.get_default("rates"):
            args.rates = "8"
    if args.trace:
        try:
            traces.read_csv(args.trace, args.l_max, args.skip_long)
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
    for t in args.traces.split(","):
        if t not in traces.TRACES:
            ap.error(f"unknown trace {t!r}; expected some of {','.join(traces.TRACES)}")
    dev = torch.device(args.device)
    rows, t0 = [], time.perf_counter()
    if args.mode in ("sizing", "both"):
        print(f"== sizing mode: {args.model}, {args.budget_gb:g} GB KV budget, sizing backend "
              "(bookkeeping only, no bytes; modelled time) ==")  # fmt: skip
        rows += run_sizing(args)
    if args.mode in ("compute", "both"):
        rows += [{"mode": "compute_real" if r.pop("real", False) else "compute", **r}
                 for r in run_compute(args, dev)]  # fmt: skip
    name = "ab" + (f"-{args.tag}" if args.tag else "")
    wall = time.perf_counter() - t0
    path = save(name, dev, rows, {"args": vars(args), "wall_s": wall}, out_dir=args.out)
    print(f"\nwall time {wall:.0f} s")
    print(f"\nsaved {path}")
    if not args.no_plot:
        for p in plot(rows, path):
            print(f"plot  {p}")


if __name__ == "__main__":
    main()
