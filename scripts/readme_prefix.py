"""docs/results.md blocks of prefix caching over every head shape (the shapes of real models),
rendered from benchmarks/bench_prefix_shapes.py's JSON; used by scripts/render_readme.py."""

from __future__ import annotations

import statistics

from readme_format import md, source

# shapes of real models in the grid: (name, head_dim, KV heads)
NAMED = [("SmolLM2-135M", 64, 3), ("Qwen2.5-0.5B", 64, 2), ("head_dim 80, 5 KV heads", 80, 5),
         ("Llama-3-8B", 128, 8), ("Gemma-2-2B", 256, 4)]  # fmt: skip


def prefix_shapes(name, doc) -> str:
    rows = doc["rows"]
    groups: dict = {}
    for r in (r for r in rows if "error" not in r):
        groups.setdefault((r["backend"], r["layout"], r["storage"]), []).append(r)
    summary = []
    for (be, lay, st), rs in groups.items():
        odd = [r for r in rs if r["pages_per_block"] > 1]
        summary.append([be, lay, st, len(rs), len(odd),
                        statistics.median(r["tokens_per_block"] for r in rs),
                        max(r["tokens_per_block"] for r in rs),
                        statistics.median(r["hit_pct"] for r in rs),
                        sum(r["hit_pct"] == 0 for r in rs),
                        max(r["waste_bytes_per_seq"] for r in rs) / 2**20,
                        max(r["enlarged_waste_bytes_per_seq"] for r in rs) / 2**20])  # fmt: skip
    out = md(["pages", "layout", "K/V storage", "shapes", "rows not dividing the page",
              "tokens a block (median)", "(max)", "prompt shared % (median)",
              "shapes sharing nothing", "worst waste a sequence, MiB",
              "with enlarged pages instead, MiB"], summary)  # fmt: skip
    named = []
    for label, d, h in NAMED:
        for r in rows:
            if (r["head_dim"], r["kv_heads"]) == (d, h) and r["storage"] in ("bf16", "fp32"):
                named.append([label, r["backend"], r["layout"], r["storage"], r["row_bytes"],
                              r["pages_per_block"], r["tokens_per_block"], r["hit_pct"],
                              r["waste_bytes_per_seq"] / 2**20,
                              r["enlarged_tokens_per_page"],
                              r["enlarged_waste_bytes_per_seq"] / 2**20])  # fmt: skip
    out += "\n" + md(["shape", "pages", "layout", "dtype", "row bytes", "pages a block",
                      "tokens a block", "prompt shared %", "waste a sequence, MiB",
                      "enlarged page: tokens", "enlarged page: waste, MiB"], named)  # fmt: skip
    built = [r for r in rows if "error" not in r]
    less = sum(r["waste_bytes_per_seq"] < r["enlarged_waste_bytes_per_seq"] for r in built)
    more = sum(r["waste_bytes_per_seq"] > r["enlarged_waste_bytes_per_seq"] for r in built)
    finer = {r["backend"] for r in built if r["enlarged_tokens_per_page"] < r["tokens_per_block"]}
    cuda_tm = [r for r in built if r["backend"] == "cuda-2M" and r["layout"] == "token_major"]
    cuda_lm = [r for r in built if r["backend"] == "cuda-2M" and r["layout"] == "layer_major"]
    none = lambda rs: sum(r["hit_pct"] == 0 for r in rs)  # noqa: E731
    ok = len(built) == len(rows) and all(
        r["hit_pct"] > 0 for r in built if r["tokens_per_block"] <= doc["system_tokens"]
    )
    verdict = (
        f"Verdict: prefix caching with the default page size "
        f"{'builds and shares' if ok else 'DIFFERS: fails or shares nothing'} in "
        f"{len(built)} of {len(rows)} shape x storage x layout x page rows (every row whose "
        f"block fits the prompt shares it). At this trace's length (2,112 tokens) blocks "
        f"waste less than enlarged whole-token pages in {less} rows and more in {more}; their "
        f"bound is one default page a table, never more than an enlarged page. Enlarged pages "
        f"would share in finer units only on {', '.join(sorted(finer)) or 'no'} pages. The "
        f"cost is coarse sharing on 2 MiB pages where the row has a large odd factor: "
        f"{none(cuda_tm)} of {len(cuda_tm)} CUDA token_major rows share none of a 2,048-token "
        f"prompt ({none(cuda_lm)} of {len(cuda_lm)} layer_major rows, where a 2 MiB page of "
        f"one layer holds thousands of tokens whatever the row)."
    )
    return out + "\n" + verdict + "\n\n" + source(name, doc)
