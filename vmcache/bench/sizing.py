"""Sizing mode's runs: which allocators, on which traces, at which request rates, spread
over worker processes (each (trace, rate, allocator) replay is independent), with one
progress line and an ETA.

Allocator names: ``static``, ``orca-ΔL``, ``paged-B``, ``vm-{layer,token}-{2M,64K}``; a
``radix-`` prefix turns on prefix caching, a ``-copy`` suffix makes forks copy instead of
share (the no-sharing baseline the copy-on-write claims are checked against).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import sys
import time

import torch

from vmcache.bench import traces
from vmcache.bench.allocators import CacheAlloc, OrcaAlloc, StaticAlloc
from vmcache.bench.simulate import DoesNotFit, simulate
from vmcache.memory.backends.sizing import SizingBackend
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.spec import KVSpec

ALLOCATORS = ("static", "orca-256", "paged-8", "paged-16", "paged-32", "vm-layer-2M",
              "vm-layer-64K", "vm-token-2M", "radix-paged-16", "radix-vm-layer-64K")  # fmt: skip
EXTRA = ("vm-token-64K", "paged-16-copy", "vm-token-2M-copy")  # by name (--allocators)
COPY_TWINS = {"paged-16": "paged-16-copy", "vm-token-2M": "vm-token-2M-copy"}
# requests per built-in trace: enough that memory binds at 16 GB for Llama-3-8B
NUM_REQUESTS = {"enterprise": 400, "long": 60, "parallel": 160, "beam": 160, "shared": 600,
                "multiturn": 400, "heavy": 2000}  # fmt: skip
PREFIX_TRACES = ("shared", "multiturn")  # radix rows run by default only where prefixes recur


def make_alloc(name: str, spec: KVSpec, budget: int, max_seqs: int = 1024,
               l_max: int = traces.L_MAX):  # fmt: skip
    """One allocator by row name (see the module doc)."""
    bpt = spec.bytes_per_token
    prefix = name.startswith("radix-")
    share = not name.endswith("-copy")
    base = name.removeprefix("radix-").removesuffix("-copy")
    parts = base.split("-")
    if len(parts) == 2 and not parts[1].isdigit():
        parts = ["?"]  # orca-x / paged-x: not a size
    if base == "static":
        return StaticAlloc(bpt, budget, l_max)
    if parts[0] == "orca" and len(parts) == 2:
        return OrcaAlloc(bpt, budget, l_max, int(parts[1]))
    if parts[0] == "paged" and len(parts) == 2:
        kv = PagedKVCache(spec, pool_bytes=budget, block_size=int(parts[1]), device="meta",
                          max_seq_len=l_max, max_seqs=max_seqs, prefix_caching=prefix,
                          scrub_on_reuse=False)  # no bytes to scrub  # fmt: skip
        return CacheAlloc(name, kv, share=share)
    if parts[0] == "vm" and len(parts) == 3 and parts[2] in ("2M", "64K"):
        page = (2 << 20) if parts[2] == "2M" else (64 << 10)
        kv = VMKVCache(spec, max_seqs, l_max, backend=SizingBackend(granularity=page),
                       pool_bytes=budget, layout=f"{parts[1]}_major", prefix_caching=prefix,
                       scrub_on_reuse=False)  # fmt: skip
        return CacheAlloc(name, kv, share=share)
    raise ValueError(f"unknown allocator {name!r}; known: {', '.join(ALLOCATORS + EXTRA)}")


def sample(trace: list, n: int | None, seed: int) -> list:
    """``n`` requests drawn without replacement (arrival order kept); all if ``n`` is None."""
    if n is None or n >= len(trace):
        return trace
    keep = sorted(random.Random(f"sample-{seed}").sample(range(len(trace)), n))
    return [trace[i] for i in keep]


# "llama-3-8b:<storage>": K/V storage dtype and scale granularity (sizes only: INT8 with
# head scales is as large as FP8, so it has no row of its own)
KV_STORAGES = {"": (None, "head"), "fp8": (torch.float8_e4m3fn, "head"),
               "fp8-token": (torch.float8_e4m3fn, "token"),
               "int8-token": (torch.int8, "token")}  # fmt: skip


def model_spec(model: str) -> KVSpec:
    """A preset's KVSpec, with the storage a ``:suffix`` names (see :data:`KV_STORAGES`)."""
    name, _, kv = model.partition(":")
    if kv not in KV_STORAGES:
        raise ValueError(f"unknown K/V storage {kv!r} in {model!r}; known: "
                         f"{', '.join(k for k in KV_STORAGES if k)}")  # fmt: skip
    kv_dtype, granularity = KV_STORAGES[kv]
    return KVSpec.preset(name, kv_dtype=kv_dtype, kv_granularity=granularity)


def _job(job: tuple) -> dict:
    tname, rate, aname, trace, model, budget_gb, seed, preemption, batch, l_max = job
    spec = model_spec(model)
    row = {"trace": tname, "rate_rps": rate, "allocator": aname, "model": model,
           "budget_GB": budget_gb, "requests": len(trace), "max_batch_tokens": batch}  # fmt: skip
    t0 = time.perf_counter()
    try:
        alloc = make_alloc(aname, spec, int(budget_gb * 1e9), l_max=l_max)
        row.update(simulate(alloc, trace, seed, preemption=preemption, max_batch_tokens=batch))
    except DoesNotFit as exc:
        row["note"] = f"does not fit: {exc}"
    row["wall_s"] = time.perf_counter() - t0
    return row


def allocators_for(trace: list, names: list[str]) -> list[str]:
    """``names``, plus the copying-forks twin of each row whose sharing claim is tested
    against it, when the trace forks (n > 1 or beams)."""
    forks = any(max(r.n, r.beam) > 1 for r in trace)
    extra = [COPY_TWINS[a] for a in names if forks and a in COPY_TWINS]
    return list(names) + [a for a in extra if a not in names]


def default_allocators(trace_name: str) -> list[str]:
    """Every default allocator; the radix rows only on traces whose prompts share prefixes."""
    radix = trace_name in PREFIX_TRACES
    return [a for a in ALLOCATORS if radix or not a.startswith("radix-")]


def run(workloads: dict, allocators: list[str] | None, args, jobs: int | None = None) -> list[dict]:
    """Every (trace, rate) of ``workloads`` through every allocator (and the copy twins the
    verdicts need); rows in a fixed order whatever order the workers finish in."""
    todo = [(tname, rate, a, trace, args.model, args.budget_gb, args.seed, args.preemption,
             args.max_batch_tokens, args.l_max)
            for (tname, rate), trace in workloads.items()
            for a in allocators_for(trace, allocators or default_allocators(tname))]  # fmt: skip
    jobs = max(1, min(jobs or mp.cpu_count(), len(todo)))
    # the slowest replays first (small pages: many page operations), so no worker idles at
    # the end while one long job runs
    slow = lambda j: ("64K" in j[2]) * 4 + j[2].startswith("radix-") * 2 + ("paged-8" in j[2])
    queue = sorted(todo, key=lambda j: (-slow(j), -len(j[3])))
    rows: list[dict] = []
    t0 = time.perf_counter()

    def show(row: dict) -> None:
        done, el = len(rows), time.perf_counter() - t0
        eta = el / done * (len(todo) - done)
        print(f"\r  [{done}/{len(todo)}] {row['trace']}/{row['allocator']} "
              f"{row['wall_s']:.1f} s; elapsed {el:.0f} s, ETA {eta:.0f} s   ", end="",
              file=sys.stderr, flush=True)  # fmt: skip

    if jobs == 1:
        for j in queue:
            rows.append(_job(j))
            show(rows[-1])
    else:
        with mp.get_context("spawn").Pool(jobs) as pool:
            for row in pool.imap_unordered(_job, queue):
                rows.append(row)
                show(row)
    print(file=sys.stderr)
    order = {(j[0], j[1], j[2]): i for i, j in enumerate(todo)}
    rows.sort(key=lambda r: order[r["trace"], r["rate_rps"], r["allocator"]])
    for r in rows:
        key = (r["trace"], r["rate_rps"])
        base = next((x for x in rows if x["allocator"] == "static" and "steps" in x
                     and (x["trace"], x["rate_rps"]) == key), None)  # fmt: skip
        if base is not None and "steps" in r:
            r["concurrency_vs_static"] = r["max_concurrent_seqs"] / base["max_concurrent_seqs"]
    return rows
