"""FP8 / INT8 K/V measured: capacity (sizing, Llama-3-8B) and accuracy against BF16 K/V.

    python -m vmcache.bench --mode quant [--quick]      (make bench-quant)

CAPACITY: sizing mode's replay (the enterprise trace, 400 requests, 16 GB of K/V, all at once)
for Llama-3-8B with BF16 K/V, FP8 with head scales and INT8 with per-token scales, on the
static, paged-16, vm-layer-2M and vm-token-2M rows: the most sequences held at once and the
internal waste. FP8 halves bytes per token, so the ratio should be about 2.0 wherever memory,
not the workload, is the limit; per-token scales add 32 bytes to each 1,024-byte row (1.94×).

ACCURACY: a seeded random Llama (4 layers, 8 heads over 2 KV heads, d_h 64, BF16 weights and
compute) on the CPU through the drop-in ``VMCache``; 4 prompts of 32 tokens, 224 new tokens.
For each storage (e4m3 and e5m2 with scale 1, e4m3 and INT8 with head scales calibrated on the
prompts by ``calibrate_kv_scales``, e4m3 and INT8 with per-token scales):
  - logits' relative error ||z − z_bf16|| / ||z_bf16|| at every decode step, teacher-forced on
    the BF16 run's tokens (median and max);
  - greedy agreement: the fraction of generated tokens equal to the BF16 run's, and the first
    position where they differ (free-running).
A random model's logits are nearly flat, so its argmax flips on small errors more easily than
a trained model's; the figures measure the storage's error, not a real model's quality.
The anchor: transformers' own ``QuantizedCache`` (quanto backend: INT4 and INT2 per group of
64, the last 128 tokens kept in full precision), by the same protocol, when optimum-quanto is
installed (``make bench-quant`` installs it); else its rows say so.

PERPLEXITY (the trained model, when it is cached): SmolLM2-135M-Instruct's perplexity of two
real texts through each storage, teacher-forced in 256-token chunks (vmcache/bench/perplexity.py);
the quality figures that carry over to a real model, and the source of calibrate_kv_scales'
defaults.
"""

from __future__ import annotations

import argparse
import statistics
import types

import torch

from vmcache.bench.common import add_out_arg, add_threads_arg, save_and_plot, table, torch_threads
from vmcache.models import DEFAULT_MODEL

PROMPT, NEW, BATCH, VOCAB = 32, 224, 4, 512
# storage: (kv_dtype, scales: None = 1.0 per head, "calibrated" head scales, "token"), or
# the anchor: ("quanto", bits)
STORAGES = {"bf16": (None, None), "fp8 e4m3": (torch.float8_e4m3fn, None),
            "fp8 e5m2": (torch.float8_e5m2, None),
            "fp8 e4m3 calibrated": (torch.float8_e4m3fn, "calibrated"),
            "int8 calibrated": (torch.int8, "calibrated"),
            "fp8 e4m3 per token": (torch.float8_e4m3fn, "token"),
            "int8 per token": (torch.int8, "token"),
            "transformers QuantizedCache int4": ("quanto", 4),
            "transformers QuantizedCache int2": ("quanto", 2)}  # fmt: skip
ANCHOR_RESIDUAL, ANCHOR_GROUP = 128, 64


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    m.generation_config.eos_token_id = None
    return m


@torch.inference_mode()
def decode(m, ids, cache, forced=None, new=NEW):
    """Greedy decode from prompts ``ids`` ``[b, T]`` with ``cache``; ``forced`` ``[b, new]``
    feeds those tokens instead of the argmax. Returns (tokens ``[b, new]``, logits fp32)."""
    out = m(input_ids=ids, past_key_values=cache, use_cache=True)
    toks, logits = [], []
    for i in range(new):
        z = out.logits[:, -1].float()
        logits.append(z)
        t = z.argmax(-1) if forced is None else forced[:, i]
        toks.append(t)
        out = m(input_ids=t[:, None], past_key_values=cache, use_cache=True)
    return torch.stack(toks, 1), torch.stack(logits, 1)


def quanto_available() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return False
    return True


def cache_factory(m, ids, new, kv, how):
    """A maker of fresh caches for one storage row (None: the anchor cannot run here)."""
    from vmcache.hf import VMCache, calibrate_kv_scales

    if kv == "quanto":
        if not quanto_available():
            return None
        from transformers.cache_utils import QuantizedCache

        return lambda: QuantizedCache(backend="quanto", config=m.config, nbits=how,
                                      residual_length=ANCHOR_RESIDUAL,
                                      q_group_size=ANCHOR_GROUP)  # fmt: skip
    scales = calibrate_kv_scales(m, ids, kv) if how == "calibrated" else None
    granularity = "token" if how == "token" else "head"
    return lambda: VMCache(m.config, PROMPT + new + 1, BATCH, kv_dtype=kv, kv_scales=scales,
                           kv_granularity=granularity)  # fmt: skip


def accuracy_rows(m, new: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=g)
    rows, base = [], None
    for name, (kv, how) in STORAGES.items():
        make = cache_factory(m, ids, new, kv, how)
        if make is None:
            rows.append({"storage": name, "kv_dtype": f"int{how}",
                         "note": "optimum-quanto not installed"})  # fmt: skip
            continue
        cache = make()
        toks, logits = decode(m, ids, cache, new=new)
        if base is None:
            base = (toks, logits)
        _, forced = decode(m, ids, make(), forced=base[0], new=new)
        err = ((forced - base[1]).norm(dim=-1) / base[1].norm(dim=-1)).flatten().tolist()
        same = toks == base[0]
        first = [int((~row).nonzero()[0]) if not row.all() else new for row in same]
        spec = getattr(getattr(cache, "kv", None), "spec", None)  # None: the anchor
        rows.append({"storage": name, "kv_dtype": f"int{how}" if spec is None else
                     str(kv or torch.bfloat16),
                     "bytes_per_token": None if spec is None else spec.bytes_per_token,
                     "logits_rel_err_median": statistics.median(err),
                     "logits_rel_err_max": max(err),
                     "greedy_agreement": float(same.float().mean()),
                     "first_divergence_min": min(first), "first_divergence_median":
                     statistics.median(first), "new_tokens": new})  # fmt: skip
        print({k: rows[-1][k] for k in ("storage", "logits_rel_err_median", "greedy_agreement")})
    return rows


def capacity_rows(num: int) -> list[dict]:
    from vmcache.bench import sizing, traces

    trace = traces.builtin("enterprise", num)
    args = types.SimpleNamespace(model=None, budget_gb=16.0, seed=0, preemption="recompute",
                                 max_batch_tokens=8192, l_max=traces.L_MAX)  # fmt: skip
    rows = []
    for model_name in MODELS:
        args.model = model_name
        for r in sizing.run({("enterprise", None): trace}, ALLOCATORS, args, jobs=2):
            rows.append({"model": model_name, "allocator": r["allocator"],
                         "max_concurrent_seqs": r.get("max_concurrent_seqs"),
                         "internal_waste_pct": r.get("internal_waste_pct"),
                         "note": r.get("note")})  # fmt: skip
    by = {(r["model"], r["allocator"]): r for r in rows}
    for r in rows:
        bf16 = by["llama-3-8b", r["allocator"]]["max_concurrent_seqs"]
        r["vs_bf16"] = (
            r["max_concurrent_seqs"] / bf16 if bf16 and r["max_concurrent_seqs"] else None
        )
    return rows


MODELS = ("llama-3-8b", "llama-3-8b:fp8", "llama-3-8b:int8-token")
ALLOCATORS = ["static", "paged-16", "vm-layer-2M", "vm-token-2M"]
CAP_COLUMNS = ["model", "allocator", "max_concurrent_seqs", "internal_waste_pct", "vs_bf16"]
ACC_COLUMNS = ["storage", "bytes_per_token", "logits_rel_err_median", "logits_rel_err_max",
               "greedy_agreement", "first_divergence_min", "first_divergence_median"]  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="16 new tokens, 100 sizing requests")
    ap.add_argument("--repeats", type=int, default=1,
                    help="unused: errors, agreements and capacities are deterministic")  # fmt: skip
    ap.add_argument(
        "--real-model",
        default=DEFAULT_MODEL,
        help="the trained model of the perplexity rows (vmcache.models.load)",
    )
    add_out_arg(ap)
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    with torch_threads(args.threads):
        return _run(args)


def _run(args):
    new, num = (16, 100) if args.quick else (NEW, 400)
    acc = accuracy_rows(model(), new)
    cap = capacity_rows(num)
    print(table(cap, CAP_COLUMNS))
    print(table(acc, ACC_COLUMNS))
    rows = [{"kind": "capacity", **r} for r in cap] + [{"kind": "accuracy", **r} for r in acc]
    extra = {"prompt_tokens": PROMPT, "new_tokens": new, "batch": BATCH, "requests": num}
    from vmcache.bench import perplexity, real

    if real.available(args.real_model):  # the trained model: real text through each storage
        print("\n-- perplexity on the trained model --")
        m, tok = real.smol(args.real_model)
        quick = ("fp32 (compute dtype)", "fp8 e4m3, unit scales", "int8, per token")
        ppl = perplexity.rows(m, tok, quick if args.quick else tuple(perplexity.STORAGES),
                              512 if args.quick else perplexity.MAX_TOKENS)  # fmt: skip
        rows += [{"kind": "perplexity", **r} for r in ppl]
        extra.update(ppl_model=real.label(args.real_model), ppl_chunk_tokens=perplexity.CHUNK)
    else:
        print("\n(perplexity rows skipped: the embedded model is not cached; run "
              "`python -m vmcache.models fetch`)")  # fmt: skip
    save_and_plot("quant", torch.device("cpu"), rows, extra, args.out, plot)
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a row whose anchor could not run (optimum-quanto missing) has no error to draw
    acc = [r for r in rows if r["kind"] == "accuracy" and "logits_rel_err_median" in r]
    cap = [r for r in rows if r["kind"] == "capacity"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar([r["storage"] for r in acc], [r["logits_rel_err_median"] for r in acc])
    axes[0].set_ylabel("logits' relative error (median)")
    axes[0].tick_params(axis="x", labelsize=7, rotation=20)
    labels = [f"{r['allocator']}\n{r['model']}" for r in cap]
    axes[1].bar(labels, [r["max_concurrent_seqs"] or 0 for r in cap])
    axes[1].set_ylabel("concurrent sequences (16 GB)")
    axes[1].tick_params(axis="x", labelsize=6)
    fig.suptitle("FP8 / INT8 K/V: accuracy vs BF16 (random model) and capacity (Llama-3-8B)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
