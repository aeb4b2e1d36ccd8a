"""Speed on the trained model (SmolLM2-135M-Instruct, 30 layers, fp32, 2 threads, greedy):
the engine over VMKVCache and PagedKVCache against transformers' continuous batching
(``generate_batch``) and padded ``generate`` batches (DynamicCache), and the drop-in caches
against DynamicCache inside ``generate``; with ``--profile``, where an engine step's time
goes. Every system runs in one process, repeats interleaved, medians with min-max.

WORKLOADS (prompts from real text, the model's chat template):
  uniform  16 questions, exactly 64 new tokens each (EOS ignored; padded: one batch of 16)
  chat     32 questions, stop at the model's EOS, at most 160 new tokens (padded: 2 × 16)
  mixed    12 requests: "summarize" prompts over standard-library docstrings of 30–1,500
           tokens, 16–96 new tokens each (EOS ignored), arriving as a Poisson process at
           2 requests/s for the engines and transformers' continuous batching (its manager,
           each request added at its arrival); padded generate (batches of 4, longest
           prompts together) gets every request at t = 0, which favours it
DROP-IN  one chat prompt at batch 1, 8 prompts left-padded at batch 8, one prompt with 4
         beams; 64 new tokens; VMCache / PagedCache / DynamicCache under the model's sdpa

Outputs: each engine's (and each padded batch's) tokens against ``generate_batch``'s, cut at
the first EOS where EOS stops; ``equal`` counts the requests whose tokens are identical.

    python benchmarks/bench_speed.py [--repeats 3] [--only uniform,chat,mixed,dropin]
    python benchmarks/bench_speed.py --profile     # the step profile only
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import random
import statistics
import time
from pathlib import Path

import torch
from common import add_out_arg, save
from transformers import DynamicCache, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from vmcache.bench.compute_real import QUESTIONS
from vmcache.bench.latency import poisson_arrivals
from vmcache.bench.perplexity import STDLIB_MODULES
from vmcache.bench.real import NAME, chat, smol
from vmcache.engine import Engine, Request, SamplingParams
from vmcache.hf import PagedCache, VMCache
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.spec import KVSpec

MORE = [
    "Explain why the sky looks blue in two sentences.",
    "List three uses of a paperclip.",
    "What is the difference between weather and climate?",
    "Write a haiku about autumn leaves.",
]


def workloads(tok, quick: bool = False) -> dict:
    """name → (prompts, max new tokens each, stop at EOS, arrival times or None, padded
    batch size); ``quick``: three requests of each, a few tokens (the test's run)."""
    qs = QUESTIONS + MORE
    uniform = [chat(tok, q) for q in qs[:16]]
    chats = [chat(tok, q) for q in (qs * 2)[:32]]
    docs = "\n\n".join(inspect.getdoc(__import__(m)) or "" for m in STDLIB_MODULES)
    words = docs.split()
    rng = random.Random("mixed")
    mixed, new = [], []
    for i, n_words in enumerate([20, 40, 60, 90, 130, 180, 250, 330, 420, 560, 720, 900]):
        at = rng.randrange(0, len(words) - n_words)
        text = " ".join(words[at : at + n_words])
        mixed.append(chat(tok, f"Summarize this documentation:\n\n{text}"))
        new.append(16 + (i * 37) % 81)
    order = sorted(range(len(mixed)), key=lambda i: rng.random())  # arrivals in random order
    mixed, new = [mixed[i] for i in order], [new[i] for i in order]
    full = {
        "uniform": (uniform, [64] * 16, False, None, 16),
        "chat": (chats, [160] * 32, True, None, 16),
        "mixed": (mixed, new, False, poisson_arrivals(len(mixed), 2.0, 7), 4),
    }
    if not quick:
        return full
    return {k: (p[:3], [min(n, 6) for n in m[:3]], stop, a and a[:3], 2)
            for k, (p, m, stop, a, _) in full.items()}  # fmt: skip


def cut(tokens, eos, stop: bool) -> list[int]:
    tokens = list(tokens)
    if stop:
        for i, t in enumerate(tokens):
            if t in eos:
                return tokens[: i + 1]
    return tokens


def engine_run(model, kind, prompts, new, stop, arrivals):
    spec = KVSpec.from_hf_config(model.config)
    longest = max(len(p) + n for p, n in zip(prompts, new))
    kw = dict(max_seqs=len(prompts), max_seq_len=longest + 16, pool_bytes=512 << 20)
    kv = VMKVCache(spec, **kw) if kind == "vm" else PagedKVCache(spec, **kw)
    engine = Engine(model, kv, max_batch_tokens=2048)
    reqs = [Request(str(i), tuple(p), SamplingParams(max_new_tokens=n, ignore_eos=not stop))
            for i, (p, n) in enumerate(zip(prompts, new))]  # fmt: skip
    t = time.perf_counter()
    out = engine.serve(reqs, arrivals) if arrivals else engine.run(reqs)
    dt = time.perf_counter() - t
    kv.close()
    return dt, [out[str(i)][0] for i in range(len(prompts))]


def batch_run(model, prompts, new, stop, eos, arrivals):
    """transformers' continuous batching: one manager (what ``generate_batch`` runs) for
    every request, each with its own ``max_new_tokens``, added at its arrival time; timed
    from the manager's start (its set-up excluded, as the engine's is) to the last result.
    Its cache is sized to hold every request at once (left to itself on a CPU it takes most of
    the machine's free memory, which beside other resident processes ended in the OOM killer)."""
    gc = GenerationConfig(max_new_tokens=max(new), do_sample=False, pad_token_id=0,
                          eos_token_id=sorted(eos) if stop else None)  # fmt: skip
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)),
                          max_generated_length=max(new), num_requests=len(prompts))  # fmt: skip
    page = ContinuousBatchingConfig.page_size  # tokens a block, every layer
    blocks = sum(-(-(len(p) + n) // page) for p, n in zip(prompts, new))
    outs = {}
    with (
        torch.inference_mode(),
        model.continuous_batching_context_manager(
            generation_config=gc,
            block=True,
            timeout=5,
            workload_hints=hints,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=blocks),
        ) as manager,
    ):
        t = time.perf_counter()
        ids = []
        for i, (p, n) in enumerate(zip(prompts, new)):
            if arrivals:
                time.sleep(max(0.0, t + arrivals[i] - time.perf_counter()))
            ids.append(manager.add_request(list(p), request_id=f"r{i}", max_new_tokens=n))
        while len(outs) < len(ids):
            res = manager.get_result(timeout=60)
            if res is None:
                raise RuntimeError("transformers' continuous batching stopped answering")
            if res.is_finished():
                outs[res.request_id] = list(res.generated_tokens)
        dt = time.perf_counter() - t
    return dt, [outs[f"r{i}"] for i in range(len(prompts))]


def padded_run(model, tok, prompts, new, stop, eos, size):
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    outs, dt = [None] * len(prompts), 0.0
    for at in range(0, len(order), size):
        idx = order[at : at + size]
        n = max(new[i] for i in idx)
        enc = tok.pad({"input_ids": [prompts[i] for i in idx]}, return_tensors="pt",
                      padding_side="left")  # fmt: skip
        kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id or 0)
        kw.update(eos_token_id=sorted(eos)) if stop else kw.update(min_new_tokens=n)
        t = time.perf_counter()
        with torch.inference_mode():
            got = model.generate(**enc, **kw)
        dt += time.perf_counter() - t
        for i, row in zip(idx, got[:, enc["input_ids"].shape[1] :].tolist()):
            outs[i] = row[: new[i]]
    return dt, outs


def eos_ids(model) -> set[int]:
    e = model.generation_config.eos_token_id
    return set(e if isinstance(e, list) else [e])


def med(xs) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def run_workloads(model, tok, names, repeats, quick=False) -> list[dict]:
    rows, eos = [], eos_ids(model)
    for name, (prompts, new, stop, arrivals, size) in workloads(tok, quick).items():
        if name not in names:
            continue
        systems = {
            "engine_vm": lambda: engine_run(model, "vm", prompts, new, stop, arrivals),
            "engine_paged": lambda: engine_run(model, "paged", prompts, new, stop, arrivals),
            "generate_batch": lambda: batch_run(model, prompts, new, stop, eos, arrivals),
            "padded_generate": lambda: padded_run(model, tok, prompts, new, stop, eos, size),
        }
        times = {k: [] for k in systems}
        outs = {}
        for rep in range(repeats):
            for k in rotated(systems, rep):
                dt, o = systems[k]()
                times[k].append(dt)
                outs[k] = [cut(x, eos, stop) for x in o]
                print(f"{name:8s} {k:16s} {dt:7.2f} s", flush=True)
        ref = outs["generate_batch"]
        tokens = sum(len(x) for x in ref)
        row = {"workload": name, "requests": len(prompts), "generated_tokens": tokens,
               "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
               "arrivals": arrivals is not None}  # fmt: skip
        for k in systems:
            row[k] = {"seconds": med(times[k]),
                      "equal": sum(a == b for a, b in zip(outs[k], ref))}  # fmt: skip
        base = {b: statistics.median(times[b]) for b in ("generate_batch", "padded_generate")}
        for k in ("engine_vm", "engine_paged"):
            t = statistics.median(times[k])
            row[k].update({f"vs_{b}": t / base[b] for b in base})
        row["paged_vs_vm"] = statistics.median(times["engine_paged"]) / statistics.median(
            times["engine_vm"]
        )
        rows.append(row)
    return rows


def dropin_cases(tok):
    one = chat(tok, QUESTIONS[0])
    eight = tok.pad({"input_ids": [chat(tok, q) for q in QUESTIONS[:8]]}, return_tensors="pt",
                    padding_side="left")  # fmt: skip
    single = {
        "input_ids": torch.tensor([one]),
        "attention_mask": torch.ones(1, len(one), dtype=torch.long),
    }
    return {"batch 1": (single, 1), "batch 8": (dict(eight), 1), "4 beams": (single, 4)}


def rotated(systems, rep: int) -> list:
    """The systems in the order repeat ``rep`` runs them: each one starts a round in turn,
    so no system always runs first or last in a round (on this shared machine the
    position alone moved a run's time by several per cent)."""
    keys = list(systems)
    r = rep % len(keys)
    return keys[r:] + keys[:r]


def run_dropin(model, tok, repeats, new=64) -> list[dict]:
    """Each case through every cache, ``repeats`` rounds in rotated order; a second
    DynamicCache ("DynamicCache again") in the rotation measures the noise floor: its
    ratio to the first is 1 but for the machine's noise."""
    rows = []
    caches = {
        "DynamicCache": lambda: DynamicCache(config=model.config),
        "VMCache": lambda: VMCache(config=model.config, max_cache_len=512),
        "PagedCache": lambda: PagedCache(config=model.config, max_cache_len=512),
        "DynamicCache again": lambda: DynamicCache(config=model.config),
    }
    for case, (enc, beams) in dropin_cases(tok).items():
        times = {k: [] for k in caches}
        outs = {}
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=beams,
                  pad_token_id=tok.pad_token_id or 0)  # fmt: skip
        for rep in range(repeats):
            for k in rotated(caches, rep):
                cache = caches[k]()
                t = time.perf_counter()
                with torch.inference_mode():
                    got = model.generate(**enc, past_key_values=cache, **kw)
                times[k].append(time.perf_counter() - t)
                outs[k] = got.tolist()
                print(f"drop-in {case:8s} {k:12s} {times[k][-1]:6.2f} s", flush=True)
        base = statistics.median(times["DynamicCache"])
        rows.append({"case": case, **{k: {"seconds": med(times[k]),
                                          "vs_dynamic": statistics.median(times[k]) / base,
                                          "equal": outs[k] == outs["DynamicCache"]}
                                      for k in caches}})  # fmt: skip
    return rows


PARTS = {  # what the profile calls each part: the functions whose cumulative time it is
    "cache writes": ("runner.py", "update"),
    "attention": ("attention.py", "vmcache_attention"),
    "scheduling": ("engine.py", "_schedule"),
    "postprocess (sampling, stops, prefix)": ("engine.py", "_postprocess"),
}


def profile(model, tok, repeats: int = 3) -> dict:
    """cProfile of the uniform workload (16 prompts, 32 new tokens) on the VM engine,
    ``repeats`` runs after a warm one, each part's median: the model's linear layers (their
    own time), the attention and cache writes (cumulative), the engine's stages, and the
    rest of the model's forward (norms, rotary, activations)."""
    prompts = workloads(tok)["uniform"][0]
    engine_run(model, "vm", prompts, [32] * 16, False, None)  # warm
    runs = []
    for _ in range(repeats):
        prof = cProfile.Profile()
        prof.enable()
        engine_run(model, "vm", prompts, [32] * 16, False, None)
        prof.disable()
        runs.append(_parts(pstats.Stats(prof).stats))
    parts = {k: statistics.median(r[0][k] for r in runs) for k in runs[0][0]}
    total = statistics.median(r[1] for r in runs)
    return {"seconds_total": total, "parts_s": parts, "repeats": repeats,
            "parts_share": {k: v / total for k, v in parts.items()},
            "calls": runs[0][2]}  # fmt: skip


def _parts(st) -> tuple[dict, float, dict]:
    total = sum(v[2] for v in st.values())  # every function's own time
    linear = sum(v[2] for (f, _, name), v in st.items() if name.endswith("_nn.linear>"))
    parts = {"model linear layers": linear}
    for part, (file, fn) in PARTS.items():
        parts[part] = sum(v[3] for (f, _, name), v in st.items() if f.endswith(file) and name == fn)
    run = sum(v[3] for (f, _, name), v in st.items() if f.endswith("engine.py") and name == "_run")
    parts["rest of the forward"] = run - linear - parts["cache writes"] - parts["attention"]
    parts["other (engine loop, Python)"] = total - sum(parts.values())
    calls = {name: v[1] for (f, _, name), v in st.items()
             if name.endswith("scaled_dot_product_attention>") or name.endswith("_nn.linear>")
             or (f.endswith(("batch.py", "coordinator.py")) and name == "write")}  # fmt: skip
    return parts, total, calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="uniform,chat,mixed,dropin")
    ap.add_argument("--profile", action="store_true", help="the step profile only")
    ap.add_argument("--quick", action="store_true", help="3 requests a workload, a few tokens")
    ap.add_argument("--before", action="store_true",
                    help="--profile of the code before a change")  # fmt: skip
    add_out_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = smol()
    cpu = torch.device("cpu")
    extra = {"model": NAME, "threads": 2, "dtype": "float32"}
    if args.profile:
        prof = profile(model, tok, args.repeats)
        for k, v in prof["parts_s"].items():
            print(f"{k:40s} {v:6.2f} s  {prof['parts_share'][k]:5.1%}")
        name = "speed_profile_before" if args.before else "speed_profile"
        print(f"saved {save(name, cpu, [prof], extra, Path(args.out))}")
        return 0
    names = set(args.only.split(","))
    rows = run_workloads(model, tok, names, args.repeats, args.quick)
    extra.update(repeats=args.repeats, quick=args.quick)
    if "dropin" in names:
        extra["dropin_repeats"] = max(args.repeats, 4)  # each cache first in a round once
        extra["dropin"] = run_dropin(model, tok, extra["dropin_repeats"],
                                     6 if args.quick else 64)  # fmt: skip
    # the drop-in alone (--only dropin) is its own file: the workloads' stay as measured
    path = save("speed_dropin" if names == {"dropin"} else "speed", cpu, rows, extra,
                Path(args.out))  # fmt: skip
    print(f"saved {path}")
    try:
        plot(rows, extra.get("dropin", []), path.with_suffix(".png"))
    except ImportError:
        pass
    return 0


def plot(rows, dropin, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    systems = ["engine_vm", "engine_paged", "generate_batch", "padded_generate"]
    width = 0.2
    for i, k in enumerate(systems):
        med_ = [r[k]["seconds"]["median"] for r in rows]
        lo = [m - r[k]["seconds"]["min"] for m, r in zip(med_, rows)]
        hi = [r[k]["seconds"]["max"] - m for m, r in zip(med_, rows)]
        a.bar([j + i * width for j in range(len(rows))], med_, width, yerr=[lo, hi], label=k)
    a.set_xticks([j + 1.5 * width for j in range(len(rows))], [r["workload"] for r in rows])
    a.set_ylabel("seconds (median, min-max)")
    a.legend()
    a.set_title("the engine against transformers (CPU, 2 threads)")
    for i, k in enumerate(["VMCache", "PagedCache", "DynamicCache again"]):
        b.bar([j + i * 0.27 for j in range(len(dropin))], [r[k]["vs_dynamic"] for r in dropin],
              0.27, label=k if i < 2 else "DynamicCache again (noise floor)")  # fmt: skip
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xticks([j + 0.27 for j in range(len(dropin))], [r["case"] for r in dropin])
    b.set_ylabel("time / DynamicCache's")
    b.legend()
    b.set_title("drop-in inside generate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
