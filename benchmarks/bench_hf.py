"""Drop-in A/B inside transformers' generate: DynamicCache, StaticCache, VMCache, PagedCache on
the same random-weight model and prompts, greedy and beam search (width 4).

    python benchmarks/bench_hf.py [--device cpu|cuda] [--quick]

Per point: decode tokens/s (new tokens of all rows / time of the generate call, prefill
included) and the KV bytes each cache holds at the end (DynamicCache: its tensors; StaticCache:
its preallocated tensors; VMCache: physical pages in use; PagedCache: its preallocated pool).
CPU model: hidden 512, 4 layers, fp32. GPU model: Llama-3.2-1B-shaped, bf16, its weights made on
the GPU. Every cache runs eager: ``generate`` would compile the model for StaticCache alone on a
GPU (``disable_compile`` turns that off here), which would time a compiler against three eager
runs. Each point is warmed up by a short ``generate`` with its own kind of cache, so kernels'
first-call compilation (Triton's on the GPU) is not timed either.
"""

from __future__ import annotations

import time

import torch
from common import parse_args, save_and_plot, table
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from vmcache.hf import PagedCache, VMCache, cache_keyword

CACHES = ("dynamic", "static", "vmcache", "paged")


def make_model(dev: torch.device) -> LlamaForCausalLM:
    if dev.type == "cuda":  # Llama-3.2-1B shape
        cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=64, max_position_embeddings=4096, dtype="bfloat16")  # fmt: skip
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                          max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    if dev.type == "cuda":  # 1.2 B weights drawn on the GPU: seconds, not a minute on the CPU
        with torch.device(dev):
            return LlamaForCausalLM(cfg).to(cfg.dtype).eval()
    return LlamaForCausalLM(cfg).eval()


def make_cache(kind: str, model, max_len: int):
    cfg = model.config
    if kind == "dynamic":
        return DynamicCache(config=cfg)
    if kind == "static":
        return StaticCache(config=cfg, max_cache_len=max_len)
    if kind == "vmcache":
        return VMCache(config=cfg, max_cache_len=max_len)
    return PagedCache(config=cfg, max_cache_len=max_len)


def kv_bytes_held(kind: str, cache) -> int:
    if kind in ("dynamic", "static"):
        return sum(
            layer.keys.numel() * layer.keys.element_size() * 2
            for layer in cache.layers
            if layer.keys is not None
        )
    if kind == "vmcache":
        return cache.stats().physical_bytes
    return cache.kv._kv_pool.numel() * cache.kv._kv_pool.element_size()


def run_point(model, dev, kind, mode, prompt, new) -> dict:
    g = torch.Generator().manual_seed(prompt)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=g).to(dev)
    beams = 4 if mode == "beam" else 1
    kw = dict(do_sample=False, num_beams=beams, pad_token_id=0, disable_compile=True)
    warm = make_cache(kind, model, prompt + 4)
    model.generate(ids, **{cache_keyword(model): warm}, max_new_tokens=4, **kw)
    del warm
    kw.update(max_new_tokens=new, min_new_tokens=new)
    cache = make_cache(kind, model, prompt + new)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = model.generate(ids, **{cache_keyword(model): cache}, **kw)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - t0
    tokens = (out.shape[1] - prompt) * beams
    return {"cache": kind, "mode": mode, "prompt": prompt, "new": new,
            "tok_per_s": tokens / elapsed, "s_per_token_step": elapsed / new,
            "kv_MiB": kv_bytes_held(kind, cache) / 2**20}  # fmt: skip


def main(argv=None):
    args, dev = parse_args(__doc__, argv)
    model = make_model(dev)
    grid = [(128, 32)] if args.quick else [(p, n) for p in (128, 1024) for n in (128, 512)]
    rows = []
    with torch.inference_mode():
        for mode in ("greedy", "beam"):
            for prompt, new in grid:
                point = [run_point(model, dev, k, mode, prompt, new) for k in CACHES]
                base = point[0]
                for r in point:
                    r["speed_vs_dynamic"] = r["tok_per_s"] / base["tok_per_s"]
                    r["kv_vs_dynamic"] = r["kv_MiB"] / base["kv_MiB"]
                rows += point
    print(table(rows, ["mode", "prompt", "new", "cache", "tok_per_s", "speed_vs_dynamic",
                       "kv_MiB", "kv_vs_dynamic"]))  # fmt: skip
    save_and_plot("hf", dev, rows, {"model": model.config.to_diff_dict()}, args.out, plot)
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    points = sorted({(r["mode"], r["prompt"], r["new"]) for r in rows})
    labels = [f"{m}\n{p}+{n}" for m, p, n in points]
    panels = ((axes[0], "speed_vs_dynamic", "tokens/s vs DynamicCache"),
              (axes[1], "kv_vs_dynamic", "KV bytes held vs DynamicCache"))  # fmt: skip
    for ax, key, title in panels:
        for i, kind in enumerate(CACHES):
            ys = [next(r[key] for r in rows if (r["mode"], r["prompt"], r["new"]) == pt
                       and r["cache"] == kind) for pt in points]  # fmt: skip
            ax.bar([x + 0.2 * i for x in range(len(points))], ys, 0.2, label=kind)
        ax.set_xticks([x + 0.3 for x in range(len(points))], labels, fontsize=7)
        ax.set_title(title)
        ax.axhline(1.0, color="k", lw=0.5)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
