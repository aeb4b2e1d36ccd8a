"""Compute mode on the trained model: the engine over VMKVCache and PagedKVCache serving real
chat requests with SmolLM2-135M-Instruct (fp32, CPU), beside the random model's rows.

REQUESTS: :data:`QUESTIONS` as chat prompts (its own template; 30-45 tokens each), up to
:data:`NEW` new tokens (``new``: 16 under ``--quick``), stopping at the model's end-of-sequence
token as a served answer does (so the two caches generate the same tokens: greedy). Arrivals
open-loop (Poisson) at ``rate`` requests/s. Rows per cache: whole prefills
(``max_batch_tokens`` 2048) and chunked (64 tokens a step, so a prompt takes several steps
beside the running decodes). Tokens/s, TTFT and TPOT: median of ``repeats`` runs with
min-max, the caches interleaved.

PREFIX ROWS: the same questions behind one long shared system prompt (a store's assistant;
the prompts share their first 514 tokens), with and without prefix caching, on both caches:
prompt tokens computed, prompt tokens served from the cache, tokens/s. VMKVCache shares in
blocks of whole tokens (256 tokens for this model's 768-byte rows on 64 KiB pages),
PagedKVCache in 16-token blocks.
"""

from __future__ import annotations

import dataclasses
import statistics

from vmcache.bench.latency import compare_tok_per_s, poisson_arrivals, spread, summarize
from vmcache.bench.real import chat, row_name, smol
from vmcache.bench.sizing import KV_STORAGES
from vmcache.engine import Engine, Request, SamplingParams
from vmcache.models import DEFAULT_MODEL
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.spec import KVSpec

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "Give me a synonym for happy.",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water at sea level?",
    "Suggest a name for a pet goldfish.",
    "How many days are there in a leap year?",
    "What does a thermometer measure?",
    "Give one tip for sleeping well.",
    "What colour is a ripe banana?",
    "Name a planet in our solar system.",
]
SYSTEM = ("You are the assistant of a hardware store. " + " ".join(
    f"Aisle {i} holds {what}; prices are on the yellow labels, and staff in blue aprons help "
    f"with anything missing on aisle {i}." for i, what in enumerate(
        ["hammers and mallets", "drills and bits", "screws, nails and wall plugs",
         "hinges and locks", "paint, brushes and rollers", "wood stain and varnish",
         "timber and plywood", "glue, sealant and tape", "garden tools and hoses",
         "seeds, compost and pots", "ladders and storage", "gloves, glasses and masks",
         "light bulbs and cables", "pipes and taps", "tiles and grout"], start=1)))  # fmt: skip
NEW, MAX_SEQ_LEN = 48, 1024
KEPT = ("prefill_tokens", "prefix_hit_tokens", "prefix_waits", "tok_per_s", "elapsed_s")
METRICS = ("tok_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def _cache(kind: str, model, max_seqs: int, prefix: bool = False, kv: str = "auto"):
    spec = KVSpec.from_hf_config(model.config)
    if kv != "auto":  # stored quantized, as sizing's KV_STORAGES name it
        kv_dtype, granularity = KV_STORAGES[kv]
        spec = dataclasses.replace(spec, kv_dtype=kv_dtype, kv_granularity=granularity)
    pool = max_seqs * MAX_SEQ_LEN * spec.bytes_per_token
    if kind == "vmcache":
        return VMKVCache(spec, max_seqs, MAX_SEQ_LEN, pool_bytes=pool, prefix_caching=prefix)
    return PagedKVCache(spec, pool_bytes=pool, block_size=16, max_seq_len=MAX_SEQ_LEN,
                        max_seqs=max_seqs, prefix_caching=prefix)  # fmt: skip


def _requests(tok, system=None, n=None, new: int = NEW) -> list[Request]:
    qs = QUESTIONS[:n] if n else QUESTIONS
    return [Request(f"q{i}", tuple(chat(tok, q, system)), SamplingParams(max_new_tokens=new))
            for i, q in enumerate(qs)]  # fmt: skip


def _once(model, kind, reqs, rate, seed, max_batch_tokens, kv):
    cache = _cache(kind, model, len(reqs), kv=kv)
    engine = Engine(model, cache, max_batch_tokens=max_batch_tokens)
    out = engine.serve(reqs, poisson_arrivals(len(reqs), rate, seed))
    d, lat = engine.stats.as_dict(), summarize(engine.latency_records())
    return out, {"tok_per_s": d["generated_tokens"] / lat["span_s"], "steps": d["steps"],
                 **{k: lat[k] for k in METRICS[1:]}}  # fmt: skip


def run(rate: float = 4.0, repeats: int = 3, n: int | None = None, kv: str = "auto",
        model_name: str = DEFAULT_MODEL, new: int = NEW) -> list:  # fmt: skip
    model, tok = smol(model_name)
    reqs = _requests(tok, n=n, new=new)
    for kind in ("vmcache", "paged"):  # warm up once per cache
        Engine(model, _cache(kind, model, 2, kv=kv)).run(reqs[:2])
    rows = []
    for label, mbt in (("whole prefills", 2048), ("chunked prefill (64)", 64)):
        runs: dict = {"vmcache": [], "paged": []}
        answers = {}
        for rep in range(repeats):
            for kind in runs:
                out, r = _once(model, kind, reqs, rate, rep, mbt, kv)
                runs[kind].append(r)
                answers[kind] = out
        for kind, rs in runs.items():
            row = {"model": row_name(model_name), "cache": kind, "prefill": label,
                   "max_batch_tokens": mbt, "rate_rps": rate, "requests": len(reqs),
                   "kv_dtype": kv,
                   "repeats": repeats, "steps": statistics.median(r["steps"] for r in rs),
                   "answers_equal_across_caches":
                   answers["vmcache"] == answers["paged"]}  # fmt: skip
            for m in METRICS:
                sp = spread([r[m] for r in rs])
                row.update({m: sp["median"], f"{m}_min": sp["min"], f"{m}_max": sp["max"]})
            rows.append(row)
        compare_tok_per_s(rows[-2], rows[-1], repeats)
    return rows


def run_prefix(n: int | None = None, kv: str = "auto", model_name: str = DEFAULT_MODEL,
               new: int = NEW) -> list[dict]:  # fmt: skip
    model, tok = smol(model_name)
    reqs = _requests(tok, SYSTEM, n, new)
    rows = []
    for kind in ("vmcache", "paged"):
        outs = {}
        for prefix in (False, True):
            engine = Engine(model, _cache(kind, model, len(reqs), prefix, kv))
            outs[prefix] = engine.run(reqs)
            d = engine.stats.as_dict()
            rows.append({"model": row_name(model_name), "scenario": "shared_system_prompt",
                         "cache": kind, "prefix_caching": prefix, "requests": len(reqs),
                         "kv_dtype": kv,
                         "prompt_tokens": sum(len(r.prompt) for r in reqs),
                         "answers_equal_without_prefix": outs[prefix] == outs[False],
                         **{k: d[k] for k in KEPT}})  # fmt: skip
    return rows
