"""Compute mode: the engine runs a real (small, randomly initialised) Llama model over
VMKVCache and PagedKVCache on the same scaled-down trace, at several KV budgets: tokens/s,
step time, map time per step, preemptions. Host backend on the CPU, CUDA backend on a GPU.

Budgets are bytes, given as how many of the trace's longest requests VMKVCache can hold at
once (``budget_requests``), so they fit any page size: on a GPU the driver's 2 MiB pages, where
a token budget sized for 4 KiB pages would not hold a single request. Both caches get the same
bytes. On CUDA the VM cache is ``token_major`` (a 2 MiB page holds a few hundred tokens of
every layer rather than thousands of one layer), and the shared system prompt of the radix
rows spans two full pages, so prefix caching can hit whatever the page size.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from vmcache.bench.latency import compare_tok_per_s, poisson_arrivals, spread, summarize
from vmcache.engine import Engine, Request, SamplingParams
from vmcache.memory.backends import Backend, make_backend
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.spec import KVSpec

MAX_SEQ_LEN = 512  # the main trace's requests: prompts <= 100, outputs <= 28


def small_model(device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    big = device.type == "cuda"
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024 if big else 256,
                      intermediate_size=2816 if big else 688, num_hidden_layers=8 if big else 4,
                      num_attention_heads=16 if big else 8, num_key_value_heads=4 if big else 2,
                      max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if big else torch.float32
    return LlamaForCausalLM(cfg).to(device, dtype).eval()


def requests(num: int, seed: int = 0) -> list[Request]:
    """The enterprise shape scaled down 10×: prompts U[50, 100], completions ~20."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        p = int(torch.randint(50, 101, (1,), generator=g))
        o = int(torch.randint(12, 29, (1,), generator=g))
        ids = torch.randint(0, 32000, (p,), generator=g).tolist()
        out.append(Request(f"r{i}", tuple(ids), SamplingParams(max_new_tokens=o)))
    return out


def shared_requests(num: int, system_len: int = 192, seed: int = 1) -> list[Request]:
    """A system prompt every request starts with, then U[16, 48] tokens of its own."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 32000, (system_len,), generator=g).tolist()
    out = []
    for i in range(num):
        own = torch.randint(0, 32000, (int(torch.randint(16, 49, (1,), generator=g)),),
                            generator=g).tolist()  # fmt: skip
        out.append(Request(f"s{i}", tuple(system + own), SamplingParams(max_new_tokens=16)))
    return out


class Setup:
    """How the VM cache is laid out on a device: the backend (made per cache), its page size
    and layout. ``backend_factory`` lets tests run the GPU setup over a strict host backend."""

    def __init__(self, device: torch.device, backend_factory=None) -> None:
        self.device = device
        self.backend_factory = backend_factory or (lambda: make_backend(device))
        probe: Backend = self.backend_factory()
        self.page_size = probe.granularity if device.type == "cuda" else 4096
        if backend_factory is not None:
            self.page_size = probe.default_page_size
        probe.close()
        self.layout = "layer_major" if self.page_size <= 64 << 10 else "token_major"

    def _tables(self, spec: KVSpec) -> tuple[int, int]:
        """(page tables per sequence, bytes of one token in one table) in this layout."""
        tables = 2 * spec.num_layers if self.layout == "layer_major" else 2
        return tables, spec.bytes_per_token // tables

    def page_for(self, spec: KVSpec, prefix: bool = False) -> int:
        """The VM page: the backend's, or with prefix caching the least multiple of it that
        holds whole token rows (per-token scales lengthen a row past a power of two)."""
        row = self._tables(spec)[1]
        return math.lcm(self.page_size, row) if prefix else self.page_size

    def vm_bytes(self, spec: KVSpec, tokens: int, prefix: bool = False) -> int:
        """Bytes VMKVCache maps for one sequence of ``tokens`` tokens (whole pages)."""
        (tables, row), page = self._tables(spec), self.page_for(spec, prefix)
        return tables * -(-tokens * row // page) * page

    def tokens_per_page(self, spec: KVSpec, prefix: bool = False) -> int:
        return self.page_for(spec, prefix) // self._tables(spec)[1]

    def make_cache(self, kind: str, spec: KVSpec, budget: int, max_seqs: int,
                   prefix: bool = False, max_seq_len: int = MAX_SEQ_LEN):  # fmt: skip
        if kind == "vmcache":
            return VMKVCache(spec, max_seqs, max_seq_len, backend=self.backend_factory(),
                             own_backend=True, page_size=self.page_for(spec, prefix),
                             pool_bytes=budget, layout=self.layout,
                             prefix_caching=prefix)  # fmt: skip
        return PagedKVCache(spec, pool_bytes=budget, block_size=16, device=self.device,
                            max_seq_len=max_seq_len, max_seqs=max_seqs,
                            prefix_caching=prefix)  # fmt: skip


METRICS = ("tok_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s")


def _once(model, setup, spec, kind, budget, reqs, rate, seed) -> dict:
    engine = Engine(model, setup.make_cache(kind, spec, budget, 64), preemption="swap")
    arrivals = poisson_arrivals(len(reqs), rate, seed)
    engine.serve(reqs, arrivals)
    d = engine.stats.as_dict()
    lat = summarize(engine.latency_records())
    return {"tok_per_s": d["generated_tokens"] / lat["span_s"], **d,
            **{k: lat[k] for k in METRICS[1:]}}  # fmt: skip


def model_and_spec(device: torch.device, kv: str = "auto"):
    """The small model, and the KVSpec its caches get: K/V in its dtype (``kv`` "auto"), or
    stored as one of sizing's :data:`~vmcache.bench.sizing.KV_STORAGES` ("fp8", ...)."""
    from vmcache.bench.sizing import KV_STORAGES

    model = small_model(device)
    model.generation_config.eos_token_id = None
    spec = KVSpec.from_hf_config(model.config, next(model.parameters()).dtype)
    if kv != "auto":
        kv_dtype, granularity = KV_STORAGES[kv]
        spec = dataclasses.replace(spec, kv_dtype=kv_dtype, kv_granularity=granularity)
    return model, spec


def run(device: torch.device, num_requests: int, rates: list[float], budgets_requests: list[int],
        repeats: int = 3, progress=None, setup: Setup | None = None,
        kv: str = "auto"):  # fmt: skip
    """Both caches at budgets of ``budgets_requests`` longest requests (VM bytes) each, the
    requests arriving open-loop (Poisson) at each rate; ``repeats`` runs per point, the two
    caches interleaved so drift hits both, reported as median with min and max. Tokens/s is
    generated tokens over the span from the first arrival to the last finish. ``kv``: the
    K/V storage (see :func:`model_and_spec`)."""
    setup = setup or Setup(device)
    model, spec = model_and_spec(device, kv)
    reqs = requests(num_requests)
    longest = max(len(r.prompt) + r.params.max_new_tokens for r in reqs)
    for kind in ("vmcache", "paged"):  # warm up (first-call costs) once per cache
        Engine(model, setup.make_cache(kind, spec, 4 * setup.vm_bytes(spec, longest), 64)).run(
            reqs[:2]
        )
    rows, total = [], len(budgets_requests) * len(rates) * repeats * 2
    for n in budgets_requests:
        budget = n * setup.vm_bytes(spec, longest)
        for rate in rates:
            runs: dict[str, list[dict]] = {"vmcache": [], "paged": []}
            for rep in range(repeats):
                for kind in runs:
                    runs[kind].append(_once(model, setup, spec, kind, budget, reqs, rate, rep))
                    if progress is not None:
                        progress(sum(map(len, runs.values())) + len(rows) * repeats, total)
            for kind, rs in runs.items():
                row = {"cache": kind, "budget_requests": n, "budget_bytes": budget,
                       "rate_rps": rate, "repeats": repeats, "page_bytes": setup.page_size,
                       "vm_layout": setup.layout, "kv_dtype": kv}  # fmt: skip
                for m in METRICS:
                    sp = spread([r[m] for r in rs])
                    row.update({m: sp["median"], f"{m}_min": sp["min"], f"{m}_max": sp["max"]})
                for k in ("steps", "max_running", "preempt_swap", "swap_bytes",
                          "map_ms_per_step", "premap_ms_per_step", "step_ms"):  # fmt: skip
                    row[k] = statistics.median(r[k] for r in rs)
                rows.append(row)
            compare_tok_per_s(rows[-2], rows[-1], repeats)
    return rows


def run_prefix(device: torch.device, num_requests: int, budget_requests: int, progress=None,
               setup: Setup | None = None, kv: str = "auto"):  # fmt: skip
    """The radix rows in compute mode: the same shared-prompt requests with and without
    prefix caching, on both caches: prompt tokens computed, tokens/s. The system prompt is
    192 tokens or two VM pages, whichever is longer, so whole pages can be shared; requests
    admitted together wait a step for the one prefilling it (``prefix_waits``)."""
    setup = setup or Setup(device)
    model, spec = model_and_spec(device, kv)
    system_len = max(192, 2 * setup.tokens_per_page(spec, prefix=True))
    reqs = shared_requests(num_requests, system_len)
    longest = max(len(r.prompt) + r.params.max_new_tokens for r in reqs)
    budget = budget_requests * setup.vm_bytes(spec, longest, prefix=True)
    rows = []
    for kind in ("vmcache", "paged"):
        for prefix in (False, True):
            cache = setup.make_cache(kind, spec, budget, 64, prefix, max_seq_len=longest)
            engine = Engine(model, cache)
            out = engine.run(reqs)
            d = engine.stats.as_dict()
            rows.append({"cache": kind, "prefix_caching": prefix, "requests": len(out),
                         "kv_dtype": kv, **{
                k: d[k] for k in ("prefill_tokens", "prefix_hit_tokens", "prefix_waits",
                                  "tok_per_s", "elapsed_s", "max_running")}})  # fmt: skip
            if progress is not None:
                progress(len(rows), 4)
    return rows
