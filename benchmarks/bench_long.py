"""Long-context decode against a measured roofline (SmolLM2-135M-Instruct, fp32, batch 4,
greedy, 2 threads): the time of one decode step at 512, 2k, 4k and 7k tokens of context for
the engine (eager and compiled, VMKVCache), the drop-in VMCache inside the model's own
forward, and transformers' DynamicCache and StaticCache, beside the least time the step's
bytes allow on this machine.

ROOFLINE  a decode step must read every weight once and every sequence's K/V once:
              bytes = weight bytes + batch × context × bytes_per_token
          (46,080 B a token here: 30 layers × K and V × 3 heads × 64 × 4 B), divided by the
          read bandwidth measured in the same run (``torch.sum`` over a 1 GiB fp32 tensor at
          the same thread count, the median of 7, before and after the systems: the higher).
          ``roofline`` = that time / the measured step; 1.0 is the memory bound. StaticCache
          reads its whole ``max_cache_len`` a step, which shows as a lower fraction: the
          roofline is the workload's, not the cache's.
PROMPTS   4 distinct texts (Python standard-library source), each cut to the context length.
          The engine serves each length as new requests whose prompts extend the previous
          length's (prefix caching on: only the new tokens are prefilled); the transformers
          caches prefill once through DynamicCache in 512-token chunks, and StaticCache and
          the drop-in receive the same K/V through their own ``update`` (the call the model
          makes in a prefill), then every cache is cropped back to the prompt after its
          decode steps. Tokens (the first from the prefill, then the decoded ones) are compared
          with DynamicCache's.
TIMED     the steps where all 4 sequences decode, after ``--warmup`` such steps; medians
          with min-max over ``--steps`` steps.

    make bench-long
    python benchmarks/bench_long.py [--contexts 512,2048,4096,7168] [--steps 10]
"""

from __future__ import annotations

import argparse
import inspect
import time
import warnings

import torch
from bench_speed import med
from common import add_out_arg, save
from transformers import DynamicCache, StaticCache

from vmcache.bench.real import NAME, smol
from vmcache.engine import Engine, Request, SamplingParams
from vmcache.hf import VMCache
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.spec import KVSpec

BATCH = 4
CHUNK = 512  # the transformers prefill's chunk
SOURCES = [("argparse", "inspect"), ("typing", "dataclasses"), ("pathlib", "logging"),
           ("subprocess", "enum")]  # fmt: skip
HF_SYSTEMS = ("dynamic", "static", "dropin_vm")
ENGINES = ("engine_vm", "engine_vm_compiled")


def read_bandwidth(threads: int, reps: int = 7) -> dict:
    """GB/s of ``torch.sum`` over a 1 GiB fp32 tensor at ``threads`` threads."""
    x = torch.ones(256 << 20)
    x.sum()
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        rates.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return med(rates)


def weight_bytes(model) -> int:
    """Bytes a forward reads of the weights: each storage once (tied embeddings count once:
    the LM head reads the whole matrix)."""
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def prompts(tok, length: int) -> list[list[int]]:
    """``BATCH`` token lists of at least ``length`` tokens, each a different pair of modules'
    source."""
    out = []
    for mods in SOURCES:
        text = "\n\n".join(inspect.getsource(__import__(m)) for m in mods)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) < length:
            raise ValueError(f"{mods} give {len(ids)} tokens, fewer than {length}")
        out.append(ids[:length])
    return out


def engine_levels(model, texts, contexts, steps, warmup) -> dict:
    """Both engines on one VMKVCache with prefix caching: per length, the eager engine
    prefills what the previous length did not, then the compiled one (its prompt all cached
    but the last unit); per engine and length, the decode steps' times and the tokens."""
    spec = KVSpec.from_hf_config(model.config)
    new = warmup + steps + 8  # the first sequences to finish prefill decode ahead
    max_len = max(contexts) + new
    room = BATCH * (max_len + 512) * spec.bytes_per_token  # + rounding to pages, map-ahead
    kv = VMKVCache(spec, max_seqs=BATCH, max_seq_len=max_len, prefix_caching=True,
                   pool_bytes=int(1.25 * room))  # fmt: skip
    t = time.perf_counter()
    engines = {"engine_vm": Engine(model, kv, max_batch_tokens=2048)}
    built = {"engine_vm": time.perf_counter() - t}
    t = time.perf_counter()
    engines["engine_vm_compiled"] = Engine(model, kv, max_batch_tokens=2048, compile=True)
    built["engine_vm_compiled"] = time.perf_counter() - t
    out = {name: {} for name in engines}
    for length in contexts:
        for name, engine in engines.items():
            ids = [f"{name}-{length}-{i}" for i in range(BATCH)]
            for rid, p in zip(ids, texts):
                params = SamplingParams(max_new_tokens=new, ignore_eos=True)
                engine.add_request(Request(rid, tuple(p[:length]), params))
            times, stats = [], engine.stats
            prefill_s = 0.0
            while engine.scheduler.has_work():
                p0, g0 = stats.prefill_tokens, stats.generated_tokens
                t = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t
                if stats.prefill_tokens == p0 and stats.generated_tokens - g0 == BATCH:
                    times.append(dt)
                elif stats.prefill_tokens > p0:
                    prefill_s += dt
            if len(times) < warmup + steps:
                raise RuntimeError(f"{name} at {length}: {len(times)} whole decode steps")
            out[name][length] = {
                "step_s": med(times[warmup : warmup + steps]),
                "prefill_s": prefill_s,
                "tokens": [engine.outputs[rid][0][: 1 + warmup + steps] for rid in ids],
            }
            print(f"  {name} @ {length}: {1e3 * out[name][length]['step_s']['median']:.1f} ms "
                  f"a step (prefill {prefill_s:.1f} s)", flush=True)  # fmt: skip
    kv.close()
    return out, built


def decode(model, cache, first, length: int, n: int) -> tuple[list[float], torch.Tensor]:
    """``n`` greedy decode steps from ``first`` ([B]) at position ``length``: their times
    and the tokens (``first`` included, [B, n + 1]); the cache is cropped back after."""
    cur, toks, times = first, [first], []
    with torch.inference_mode():
        for i in range(n):
            pos = torch.tensor([length + i])
            t = time.perf_counter()
            logits = model(input_ids=cur[:, None], past_key_values=cache, cache_position=pos,
                           use_cache=True).logits  # fmt: skip
            cur = logits[:, -1].argmax(-1)
            times.append(time.perf_counter() - t)
            toks.append(cur)
    cache.crop(-n)
    return times, torch.stack(toks, 1)


def hf_levels(model, texts, contexts, steps, warmup) -> dict:
    """DynamicCache prefills each length's new tokens; StaticCache and the drop-in take the
    same K/V through ``update``; each decodes and is cropped back."""
    n = warmup + steps
    caches = {
        "dynamic": DynamicCache(config=model.config),
        "static": StaticCache(config=model.config, max_cache_len=max(contexts) + n),
        "dropin_vm": VMCache(config=model.config, max_cache_len=max(contexts) + n),
    }
    ids = torch.tensor([p[: max(contexts)] for p in texts])
    out, done = {name: {} for name in caches}, 0
    for length in contexts:
        t = time.perf_counter()
        with torch.inference_mode():
            for a in range(done, length, CHUNK):
                b = min(a + CHUNK, length)
                logits = model(input_ids=ids[:, a:b], past_key_values=caches["dynamic"],
                               cache_position=torch.arange(a, b), use_cache=True,
                               logits_to_keep=1).logits  # fmt: skip
            for i, layer in enumerate(caches["dynamic"].layers):
                k, v = layer.keys[:, :, done:length], layer.values[:, :, done:length]
                for name in ("static", "dropin_vm"):
                    caches[name].update(k, v, i)
        prefill_s = time.perf_counter() - t
        first = logits[:, -1].argmax(-1)
        for name, cache in caches.items():
            times, toks = decode(model, cache, first, length, n)
            out[name][length] = {"step_s": med(times[warmup:]), "prefill_s": prefill_s,
                                 "tokens": toks.tolist()}  # fmt: skip
            print(f"  {name} @ {length}: {1e3 * out[name][length]['step_s']['median']:.1f} ms "
                  "a step", flush=True)  # fmt: skip
        done = length
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,2048,4096,7168")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    add_out_arg(ap)
    args = ap.parse_args(argv)
    contexts = sorted(int(c) for c in args.contexts.split(","))
    torch.set_num_threads(args.threads)
    # transformers 5.2x renames ``past_key_values``; the oldest supported release knows only it
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")
    model, tok = smol()
    spec = KVSpec.from_hf_config(model.config)
    if max(contexts) + args.warmup + args.steps > model.config.max_position_embeddings:
        raise SystemExit(f"contexts past the model's {model.config.max_position_embeddings}")
    texts = prompts(tok, max(contexts))
    probes = [read_bandwidth(args.threads)]
    wbytes = weight_bytes(model)
    print(f"read bandwidth {probes[0]['median']:.1f} GB/s; weights {wbytes / 1e6:.0f} MB",
          flush=True)  # fmt: skip
    hf = hf_levels(model, texts, contexts, args.steps, args.warmup)
    eng, built = engine_levels(model, texts, contexts, args.steps, args.warmup)
    results = {**hf, **eng}
    probes.append(read_bandwidth(args.threads))
    bw = max(probes, key=lambda p: p["median"])  # the machine's, where a neighbour slowed one
    rows = []
    for length in contexts:
        # mean history a timed step reads: the prompt, the first token, the warm-up steps
        ctx = length + 1 + args.warmup + (args.steps - 1) / 2
        nbytes = wbytes + BATCH * ctx * spec.bytes_per_token
        bound_s = nbytes / (bw["median"] * 1e9)
        ref = results["dynamic"][length]["tokens"]
        row = {"context": length, "batch": BATCH, "bytes_per_step": nbytes,
               "kv_bytes_per_step": BATCH * ctx * spec.bytes_per_token,
               "roofline_s": bound_s}  # fmt: skip
        for name in (*ENGINES, *HF_SYSTEMS):
            r = results[name][length]
            step = r["step_s"]["median"]
            row[name] = {"step_s": r["step_s"], "roofline": bound_s / step,
                         "gb_per_s": nbytes / step / 1e9, "prefill_s": r["prefill_s"],
                         "equal": sum(a == b for a, b in zip(r["tokens"], ref))}  # fmt: skip
        rows.append(row)
        shares = "; ".join(f"{k} {row[k]['roofline']:.0%}" for k in (*ENGINES, *HF_SYSTEMS))
        print(f"{length}: roofline {1e3 * bound_s:.1f} ms; {shares}", flush=True)
    extra = {"model": NAME, "threads": args.threads, "read_bandwidth_gb_s": bw,
             "bandwidth_probes_gb_s": [p["median"] for p in probes],
             "weight_bytes": wbytes, "bytes_per_token": spec.bytes_per_token,
             "steps": args.steps, "warmup": args.warmup, "startup_s": built,
             "bandwidth_probe": "torch.sum over a 1 GiB fp32 tensor, median of 7, before and "
                                "after the systems; the higher"}  # fmt: skip
    print(save("long", torch.device("cpu"), rows, extra, out_dir=args.out))


if __name__ == "__main__":
    main()
