"""KV memory against context length on a hybrid sliding-window model (Gemma-3-style: five
sliding layers of W = 512 per full-attention layer), for transformers' DynamicCache, VMCache
(both layouts) and PagedCache, next to the minimum (full layers × L + sliding layers × W)
and to what full attention would hold.

    python benchmarks/bench_window.py [--device cpu|cuda] [--quick]

The same seeded random model reads the same tokens through each cache: chunks of 511 tokens
then one decode token (so every measurement is taken after a step that released what left
the window), to 8,192 tokens (--quick: 2,048). Bytes: DynamicCache, its K/V tensors;
VMCache, physical pages in use (4 KiB pages: 64 tokens of one layer's K or V here);
PagedCache, blocks in use (B = 16; its pool is preallocated on top). Each cache's last
logits are compared with DynamicCache's (max |Δ| recorded; the run fails above 1e-4).
"""

from __future__ import annotations

import torch
from common import parse_args, save_and_plot, table
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

from vmcache.hf import PagedCache, VMCache, cache_keyword
from vmcache.sequences.spec import KVSpec

W = 512
CACHES = ("dynamic", "vmcache", "vmcache_token_major", "paged")


def make_model(dev: torch.device, max_len: int) -> Gemma3ForCausalLM:
    cfg = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=W,
        max_position_embeddings=max_len + 8,
    )  # fmt: skip
    torch.manual_seed(0)
    return Gemma3ForCausalLM(cfg).to(dev).eval()


def make_cache(kind: str, model, max_len: int):
    cfg = model.config
    if kind == "dynamic":
        return DynamicCache(config=cfg)
    if kind == "paged":
        return PagedCache(config=cfg, max_cache_len=max_len, block_size=16)
    layout = "token_major" if kind.endswith("token_major") else "layer_major"
    return VMCache(config=cfg, max_cache_len=max_len, page_size=4096, layout=layout)


def held_bytes(kind: str, cache) -> int:
    if kind == "dynamic":
        return sum(x.numel() * x.element_size() for layer in cache.layers
                   for x in (layer.keys, layer.values) if x is not None)  # fmt: skip
    return cache.stats().physical_bytes


@torch.inference_mode()
def run(kind: str, model, ids: torch.Tensor, checkpoints: list[int]):
    cache = make_cache(kind, model, ids.shape[1])
    key = cache_keyword(model)
    rows, pos, logits = [], 0, None
    while pos < ids.shape[1]:
        for n in (511, 1):  # a chunk, then one decode token at a multiple of 512
            logits = model(ids[:, pos : pos + n], **{key: cache}).logits[:, -1]
            pos += n
        if pos in checkpoints:
            rows.append({"cache": kind, "tokens": pos, "kv_bytes": held_bytes(kind, cache)})
    if kind != "dynamic":  # the bound: one page per sliding table past the minimum
        kv = cache.kv
        slack = sum(len(g.ids) for g in kv._groups if g.sliding) * kv.config.page_bytes
        for r in rows:
            r["slack_bytes"] = slack
    return rows, logits


def main(argv=None):
    args, dev = parse_args(__doc__, argv)
    length = 2048 if args.quick else 8192
    checkpoints = [n for n in (512, 1024, 2048, 4096, 8192) if n <= length]
    model = make_model(dev, length)
    spec = KVSpec.from_hf_config(model.config, torch.float32)
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(dev)
    rows, ref = [], None
    for kind in CACHES:
        got, logits = run(kind, model, ids, checkpoints)
        if ref is None:
            ref = logits
        diff = float((logits - ref).abs().max())
        if diff > 1e-4:
            raise SystemExit(f"{kind}: last logits differ from DynamicCache's by {diff}")
        for r in got:
            r["max_abs_logit_diff"] = diff
        rows += got
    for n in checkpoints:
        rows.append({"cache": "minimum (window)", "tokens": n, "kv_bytes": spec.window_kv_bytes(n)})
        rows.append({"cache": "full attention", "tokens": n, "kv_bytes": spec.kv_bytes(n)})
    for r in rows:
        r["kv_KiB"] = r["kv_bytes"] / 1024
    print(table(rows, ["cache", "tokens", "kv_KiB"]))
    extra = {"model": model.config.to_diff_dict(), "window": W}
    save_and_plot("window", dev, rows, extra, args.out, plot)
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind in dict.fromkeys(r["cache"] for r in rows):
        pts = [(r["tokens"], r["kv_bytes"] / 1024) for r in rows if r["cache"] == kind]
        style = "--" if kind in ("minimum (window)", "full attention") else "-o"
        ax.plot(*zip(*pts), style, label=kind, ms=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV bytes held (KiB)")
    ax.set_title(f"Gemma-3-style (5 sliding W={W} : 1 full), one sequence")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
