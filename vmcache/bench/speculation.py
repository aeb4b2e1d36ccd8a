"""Speculative decoding measured: the engine with prompt-lookup drafts against the same engine
without, on a workload where drafts can match and on one where they cannot.

    python -m vmcache.bench --mode spec [--quick] [--repeats 3]      (make bench-spec)

WORKLOADS: "quoting": prompts that repeat a phrase three times, greedy (an answer that quotes
its input is where prompt lookup helps: summaries, code edits, retrieval-grounded answers);
"sampled": random prompts sampled at temperature 1 (a random model's sampled text almost never
repeats, so drafts rarely match: the overhead of proposing, verifying and rolling back).
16 requests of 48 prompt tokens and 48 new tokens each, all at once.

MODEL AND CACHES: a seeded random Llama (4 layers, fp32) on the CPU; VMKVCache (layer_major and
token_major, 4 KiB pages, host backend) and PagedKVCache (16-token blocks). Speculation:
NgramDrafter(k=4, adaptive) as a chain, and as a token tree of up to 3 chains verified both
ways (vmcache/engine/tree.py): "mask", one sequence with a tree mask (the accepted path moved
into place, only tokens off the first chain copied), and "forks", a fork per extra chain
sharing the history's pages (the page holding the branch point copied on its first write).
Per verification step the rows give the K/V bytes the tree copied and the page-table entries
mapped (a fork maps its whole history again: every page on the VM caches, every block id on
paged); the engine's default tree mode is the one that copies and maps less here.

ROWS: target steps (engine steps), generated tokens per target step, drafts proposed and
accepted (acceptance), rejected drafts rolled back (truncated: pages unmapped, no K/V copied;
the copy-on-write byte counter confirms), whether every answer equals the engine's without
speculation (greedy rows; sampled rows keep the distribution, not the tokens), and wall time
(median of --repeats, min-max) with its ratio to no speculation.

A random model on a CPU measures the mechanism and its overhead, not a real model's
acceptance: a random model's greedy text loops, which a quoting prompt's drafts then match
more often than a real model's would; the "sampled" rows are the cost when little matches.
On a GPU a step of several tokens costs about what a one-token decode step costs (decode is
bound by reading K/V and weights), so fewer target steps is the number that carries over.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vmcache.bench.common import (
    add_out_arg,
    add_threads_arg,
    save,
    save_and_plot,
    table,
    torch_threads,
)
from vmcache.engine import Engine, NgramDrafter, Request, SamplingParams
from vmcache.memory.backends.host import HostBackend
from vmcache.models import DEFAULT_MODEL
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.spec import KVSpec

PROMPT, NEW, VOCAB = 48, 48, 512


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = None
    return m


def requests(workload: str, n: int) -> list[Request]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        if workload == "quoting":
            phrase = torch.randint(0, VOCAB, (PROMPT // 3,), generator=g).tolist()
            prompt = phrase * 3
            params = SamplingParams(max_new_tokens=NEW)
        else:
            prompt = torch.randint(0, VOCAB, (PROMPT,), generator=g).tolist()
            params = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=i)
        out.append(Request(f"{workload}{i}", tuple(prompt), params))
    return out


def make_cache(kind: str, spec: KVSpec, n: int):
    tokens = 3 * n * (PROMPT + NEW + 16)  # room for a tree's forks too
    if kind.startswith("vm"):
        pages = tokens * spec.bytes_per_token // 4096 + 64
        layout = "token_major" if kind == "vm_token_major" else "layer_major"
        return VMKVCache(spec, 3 * n, PROMPT + NEW + 8, page_size=4096, layout=layout,
                         pool_bytes=pages * 4096, backend=HostBackend())  # fmt: skip
    return PagedKVCache(spec, num_blocks=tokens // 16 + 64, block_size=16,
                        max_seq_len=PROMPT + NEW + 8, max_seqs=3 * n)  # fmt: skip


def run_once(m, kind: str, workload: str, n: int, speculative) -> tuple[dict, dict]:
    spec = KVSpec.from_hf_config(m.config)
    cache = make_cache(kind, spec, n)
    engine = Engine(m, cache, speculative=speculative)
    t0 = time.perf_counter()
    out = engine.run(requests(workload, n))
    wall = time.perf_counter() - t0
    st = engine.stats
    row = {
        "steps": st.steps,
        "generated_tokens": st.generated_tokens,
        "wall_s": wall,
        "spec_proposed": st.speculation.proposed,
        "spec_accepted": st.speculation.accepted,
        "rolled_back_tokens": st.speculation.rolled_back,
        "cow_bytes_copied": cache.stats().cow_bytes_copied,
        "verify_steps": st.speculation.steps,
        "tree_branches": st.speculation.tree_branches,
        "tree_wins": st.speculation.tree_wins,
        "tree_steps": st.speculation.tree_steps,
        "tree_copied_bytes": st.speculation.tree_copied_bytes,
        "spec_mapped_pages": st.speculation.mapped_pages,
    }
    cache.close()
    return row, out


def rows_for(m, kind: str, workload: str, n: int, repeats: int) -> list[dict]:
    rows, base_out, base_wall = [], None, None
    variants = (
        ("none", None),
        ("ngram k=4", NgramDrafter(k=4)),
        ("ngram tree 3x4 (mask)", NgramDrafter(k=4, branches=3, tree_mode="mask")),
        ("ngram tree 3x4 (forks)", NgramDrafter(k=4, branches=3, tree_mode="fork")),
    )
    for name, drafter in variants:
        runs = [run_once(m, kind, workload, n, drafter) for _ in range(repeats)]
        walls = [r["wall_s"] for r, _ in runs]
        row, out = runs[0]
        row.update(cache=kind, workload=workload, speculation=name, repeats=repeats,
                   wall_s=statistics.median(walls), wall_s_min=min(walls),
                   wall_s_max=max(walls))  # fmt: skip
        row["tokens_per_step"] = row["generated_tokens"] / row["steps"]
        verifies = max(row["verify_steps"], 1)
        row["tree_copied_bytes_per_verify"] = row["tree_copied_bytes"] / verifies
        row["mapped_pages_per_verify"] = row["spec_mapped_pages"] / verifies
        row["acceptance"] = row["spec_accepted"] / row["spec_proposed"] if drafter else None
        if base_out is None:
            base_out, base_wall = out, row["wall_s"]
        row["answers_equal_none"] = out == base_out if workload == "quoting" else None
        row["wall_vs_none"] = row["wall_s"] / base_wall
        rows.append(row)
        print(
            kind,
            workload,
            name,
            {k: row[k] for k in ("steps", "tokens_per_step", "acceptance", "wall_s")},
        )
    return rows


REAL_COLUMNS = ["workload", "speculation", "steps", "tokens_per_step", "acceptance",
                "tokens_per_verify", "answers_equal_none", "wall_s", "wall_vs_none"]  # fmt: skip
COLUMNS = ["cache", "workload", "speculation", "steps", "tokens_per_step", "spec_proposed",
           "spec_accepted", "acceptance", "rolled_back_tokens", "tree_branches", "tree_wins",
           "tree_copied_bytes_per_verify", "mapped_pages_per_verify", "answers_equal_none",
           "wall_s", "wall_vs_none"]  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 4 requests per workload")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument(
        "--real-model",
        default=DEFAULT_MODEL,
        help="the trained chat model of the real-task rows (vmcache.models.load)",
    )
    add_out_arg(ap)
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    with torch_threads(args.threads):
        return _run(args)


def _run(args):
    m = model()
    n, reps = (4, 1) if args.quick else (args.requests, args.repeats)
    rows = [r for kind in ("vm", "vm_token_major", "paged") for w in ("quoting", "sampled")
            for r in rows_for(m, kind, w, n, reps)]  # fmt: skip
    print(table(rows, COLUMNS))
    extra = {"prompt_tokens": PROMPT, "new_tokens": NEW, "requests": n}
    save_and_plot("spec", torch.device("cpu"), rows, extra, args.out, plot)
    from vmcache.bench import real, speculation_real

    if real.available(args.real_model):  # the trained model on real tasks: its own file
        print("\n-- speculation on the trained model, real tasks --")
        new = 16 if args.quick else 96
        real_rows = speculation_real.rows(reps, new, 1 if args.quick else None, args.real_model)
        print(table(real_rows, REAL_COLUMNS))
        save("spec_real", torch.device("cpu"), real_rows,
             {"model": real.label(args.real_model), "new_tokens": new},
             out_dir=args.out)  # fmt: skip
        rows = rows + real_rows
    else:
        print("\n(real-task rows skipped: the embedded model is not cached; run "
              "`python -m vmcache.models fetch`)")  # fmt: skip
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['cache']}\n{r['workload']}" for r in rows if r["speculation"] == "none"]
    names = list(dict.fromkeys(r["speculation"] for r in rows))
    for i, name in enumerate(names):
        rs = [r for r in rows if r["speculation"] == name]
        x = [j + 0.2 * i for j in range(len(rs))]
        axes[0].bar(x, [r["steps"] for r in rs], 0.2, label=name)
        axes[1].bar(x, [r["wall_s"] for r in rs], 0.2, label=name)
    for ax, label in zip(axes, ("target steps", "wall time (s)")):
        ax.set_xticks([j + 0.3 for j in range(len(labels))], labels, fontsize=7)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("speculative decoding (prompt lookup) vs none: same answers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
