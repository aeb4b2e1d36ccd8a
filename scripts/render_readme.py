"""Render the result tables of the README and docs/results.md from the committed JSON in
benchmarks/results.

Every generated block sits between two markers, and only this script writes inside them:

    <!-- generated: NAME -->
    ...tables rendered from JSON...
    <!-- end: NAME -->

    python scripts/render_readme.py          # rewrite the blocks in README.md, docs/results.md
    python scripts/render_readme.py --check  # exit 1 naming every block that differs

tests/project/test_readme_results.py runs the check, so a figure edited by hand, or JSON changed
without re-rendering, fails the test suite. Each block names the JSON it came from, with the
date, the machine and the commit that produced it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its helper modules

from readme_format import ROOT, f, md, newest, source  # noqa: E402
from readme_long import BLOCKS as LONG_BLOCKS  # noqa: E402
from readme_memory import elastic, handoff, tiers, window  # noqa: E402
from readme_multi import multi, multi_headline  # noqa: E402
from readme_prefix import prefix_shapes  # noqa: E402
from readme_quant_spec import quant, spec  # noqa: E402
from readme_real import compute_real, quant_ppl, spec_real  # noqa: E402
from readme_server import BLOCKS as SERVER_BLOCKS  # noqa: E402
from readme_speed import BLOCKS as SPEED_BLOCKS  # noqa: E402
from readme_vllm_kv import vllm_kv  # noqa: E402

README = os.path.join(ROOT, "README.md")
DOCS = [README, os.path.join(ROOT, "docs", "results.md")]  # the files with generated blocks
BLOCK = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end: \2 -->)", re.S)


def _sizing(doc):
    return [r for r in doc["rows"] if "mode" not in r]


def ab_capacity(name, doc) -> str:
    rows = [r for r in _sizing(doc) if r.get("rate_rps") is None and r["trace"] == "enterprise"]
    out = md(["allocator", "internal waste %", "reservation waste %", "worst seq waste (tok)",
              "p99 seq waste (tok)", "frag. stalls", "max seqs", "memory binding", "preemptions",
              "recomputed tok", "prefill tok", "bytes copied", "verdict"],
             [[r["allocator"], r["internal_waste_pct"], r["reservation_waste_pct"],
               r["seq_waste_max_tok"], r["seq_waste_p99_tok"], r["frag_stalls"],
               r["max_concurrent_seqs"], r["memory_binding"], r["preemptions"],
               r["recompute_tokens"], r["prefill_tokens"], r["bytes_copied"],
               r.get("verdict", "")] for r in rows if "steps" in r])  # fmt: skip
    return out + "\n" + source(name, doc)


def ab_claims(name, doc) -> str:
    rows = [r for r in _sizing(doc) if r.get("seed_claim") and "steps" in r]
    return md(["trace", "allocator", "claim", "max seqs", "memory binding", "verdict"],
              [[r["trace"] + (f" @ {r['rate_rps']:g}/s" if r.get("rate_rps") else ""),
                r["allocator"], r["seed_claim"], r["max_concurrent_seqs"], r["memory_binding"],
                r["verdict"]] for r in rows]) + "\n" + source(name, doc)  # fmt: skip


def ab_forks(name, doc) -> str:
    rows = [r for r in _sizing(doc) if r["trace"] in ("parallel", "beam") and "steps" in r]
    return md(["trace", "allocator", "CoW saving %", "tokens / modelled s", "max seqs",
               "preemptions", "bytes copied"],
              [[r["trace"], r["allocator"], r["cow_saving_pct"], r["tokens_per_modelled_s"],
                r["max_concurrent_seqs"], r["preemptions"], r["bytes_copied"]]
               for r in rows]) + "\n" + source(name, doc)  # fmt: skip


def ab_radix(name, doc) -> str:
    rows = [r for r in _sizing(doc) if r["trace"] in ("shared", "multiturn") and "steps" in r
            and ("paged-16" in r["allocator"] or "vm-layer-64K" in r["allocator"])]  # fmt: skip
    return md(["trace", "allocator", "prompt tok computed", "recomputed tok", "peak KV held GB",
               "max seqs", "prefix waits", "verdict"],
              [[r["trace"], r["allocator"], r["prefill_tokens"], r["recompute_tokens"],
                r["peak_held_GB"], r["max_concurrent_seqs"], r["prefix_waits"],
                r.get("verdict", "")] for r in rows]) + "\n" + source(name, doc)  # fmt: skip


def ab_rates(name, doc) -> str:
    rows = [r for r in _sizing(doc) if r.get("rate_rps") is not None and "steps" in r]
    rows.sort(key=lambda r: (r["allocator"], r["rate_rps"]))
    return md(["allocator", "req/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms",
               "goodput req/s", "max seqs", "preemptions", "memory binding"],
              [[r["allocator"], r["rate_rps"], r["model_ttft_p50_s"], r["model_ttft_p99_s"],
                1e3 * r["model_tpot_p50_s"], 1e3 * r["model_tpot_p99_s"],
                r["model_goodput_rps"], r["max_concurrent_seqs"], r["preemptions"],
                r["memory_binding"]] for r in rows]) + "\n" + source(name, doc)  # fmt: skip


def ab_30k(name, doc) -> str:
    rows = [r for r in _sizing(doc) if "steps" in r]
    wall = doc.get("wall_s")
    head = (f"{rows[0]['requests']:,} requests at {rows[0]['rate_rps']:g} req/s, "
            f"{len(rows)} allocators, {doc['args'].get('jobs') or doc.get('cores')} worker "
            f"processes: **{wall:.0f} s wall** in all.\n\n" if rows and wall else "")  # fmt: skip
    return head + md(["allocator", "replay s (one core)", "steps", "max seqs", "preemptions",
                      "internal waste %", "worst seq waste (tok)", "TTFT p99 s (modelled)"],
                     [[r["allocator"], r["wall_s"], r["steps"], r["max_concurrent_seqs"],
                       r["preemptions"], r["internal_waste_pct"], r["seq_waste_max_tok"],
                       r["model_ttft_p99_s"]] for r in rows]
                     ) + "\n" + source(name, doc)  # fmt: skip


def _mm(r, k, scale=1.0) -> str:
    return f"{r[k] * scale:.3g} ({r[k + '_min'] * scale:.3g}–{r[k + '_max'] * scale:.3g})"


def compute(name, doc) -> str:
    rows = [r for r in doc["rows"] if r.get("mode") == "compute" and "rate_rps" in r]
    out = md(["cache", "KV budget (requests)", "req/s", "tokens/s", "TTFT p50 ms",
              "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "vm / paged tok/s", "spread"],
             [[r["cache"], r["budget_requests"], r["rate_rps"], _mm(r, "tok_per_s"),
               _mm(r, "ttft_p50_s", 1e3), _mm(r, "ttft_p99_s", 1e3), _mm(r, "tpot_p50_s", 1e3),
               _mm(r, "tpot_p99_s", 1e3), r["vm_vs_paged_tok_per_s"], r["spread_note"]]
              for r in rows])  # fmt: skip
    radix = [r for r in doc["rows"] if r.get("scenario") == "shared_prompt"]
    if radix:
        out += "\n" + md(["cache", "prefix caching", "prompt tok computed", "prefix hit tok",
                          "prefix waits", "tokens/s (one run)"],
                         [[r["cache"], r["prefix_caching"], r["prefill_tokens"],
                           r["prefix_hit_tokens"], r["prefix_waits"], r["tok_per_s"]]
                          for r in radix])  # fmt: skip
    return out + "\n" + source(name, doc)


def kernels(name, doc) -> str:
    rows = doc["rows"]
    pts = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["impl"], r["batch"], r["context"]): r for r in rows}

    def cell(r):
        if "us_min" not in r:
            return f"{r['us']:,.0f} (one run)"
        return f"{r['us']:,.0f} ({r['us_min']:,.0f}–{r['us_max']:,.0f})"

    out = md(["impl, median µs (min–max of repeats)"] + [f"batch {b} × {c}" for b, c in pts],
             [[i] + [cell(by[i, b, c]) if (i, b, c) in by else "–" for b, c in pts]
              for i in impls])  # fmt: skip
    ratios = [r for r in rows if "vs_plain" in r]
    if ratios:
        out += "\n" + md(["vmcache memory vs an ordinary tensor"] + [f"batch {b} × {c}"
                                                                  for b, c in pts],
                         [["time ratio (spread > effect: within noise)"]
                          + [f"{r['vs_plain']:.2f}" + (" (spread > effect)"
                                                       if r.get("spread_note") else "")
                             for r in ratios]])  # fmt: skip
    quant = [r for r in rows if "vs_bf16" in r]
    if quant:
        names = list(dict.fromkeys(r["impl"] for r in quant))
        qby = {(r["impl"], r["batch"], r["context"]): r["vs_bf16"] for r in quant}
        out += "\n" + md(["quantized K/V: time vs the same impl at the compute dtype"]
                         + [f"batch {b} × {c}" for b, c in pts],
                         [[i] + [f"{qby[i, b, c]:.2f}" if (i, b, c) in qby else "–"
                                 for b, c in pts] for i in names])  # fmt: skip
    return out + "\n" + source(name, doc)


def vmm(name, doc) -> str:
    rows = doc["rows"]
    return md(["operation", "page", "µs (median of 5 repeats, or one timed batch)",
               "min–max of the repeats", "fork / copy"],
              [[r["op"], f"{r['page_size'] // 1024} KiB", r.get("us", r.get("map_us")),
                f"{f(r['us_min'])}–{f(r['us_max'])}" if "us_min" in r else "one timed batch",
                r.get("fork_vs_copy", "")] for r in rows]) + "\n" + source(name, doc)  # fmt: skip


def hf(name, doc) -> str:
    rows = doc["rows"]
    pts = list(dict.fromkeys((r["mode"], r["prompt"], r["new"]) for r in rows))
    by = {(r["cache"], r["mode"], r["prompt"], r["new"]): r for r in rows}
    caches = [c for c in ("static", "vmcache", "paged") if any(k[0] == c for k in by)]
    return md(["mode", "prompt + new"] + [f"{c} speed" for c in caches]
              + [f"{c} KV" for c in caches if c != "static"],
              [[m, f"{p} + {n}"] + [by[c, m, p, n]["speed_vs_dynamic"] for c in caches]
               + [by[c, m, p, n]["kv_vs_dynamic"] for c in caches if c != "static"]
               for m, p, n in pts]) + "\n" + source(name, doc)  # fmt: skip


GOAL_MIN = {"make test": 12, "make bench": 6}  # a newcomer's pace on 2 cores (issue 50)


def fresh_clone(name, doc) -> str:
    """Both commands' wall time on a fresh clone, set-up and work apart, against the goals."""
    by = {(r["command"], r["phase"]): r for r in doc["rows"]}
    parts = []
    for cmd, work in (("make test", "tests"), ("make bench", "harness")):
        if (cmd, "total") not in by:
            continue
        total, mins = by[cmd, "total"], by[cmd, "total"]["wall_s"] / 60
        verdict = ("**failed**" if total["rc"] else f"within its {GOAL_MIN[cmd]}"
                   if mins <= GOAL_MIN[cmd] else f"**OVER** its {GOAL_MIN[cmd]}")  # fmt: skip
        parts.append(f"`{cmd}` **{mins:.1f} min** ({verdict}; set-up "
                     f"{by[cmd, 'set-up']['wall_s'] / 60:.1f}, {work} "
                     f"{by.get((cmd, work), {}).get('wall_s', 0) / 60:.1f})")  # fmt: skip
    return (
        f"On a fresh clone, {doc['device']} ({doc.get('cpu', '?')}), venvs from pip's cache "
        f"and the model converted once a transformers release: {'; '.join(parts)} "
        f"(`benchmarks/results/{name}`, {doc['date']}, commit {doc['clone_of'][:10]}).\n"
    )


def chaos(name, doc) -> str:
    """benchmarks/chaos_ledger.py's run: the verdict and every fault's checks, as computed by
    the run itself (this only formats them)."""
    s = doc["summary"]
    rows = [[r["fault"], r["target"], r["detail"] or "", r["ledger_agrees"], r["settle_s"],
             r["errors"]] for r in doc["rows"]]  # fmt: skip
    head = (
        f"{s['minutes']:g} minutes, servers {', '.join(s['servers'])} on one ledger, "
        f"{s['faults']} faults: {s['requests']:,} requests, {s['failed']} failed, "
        f"{s['tokens_differ']} with other tokens than the prompt's first answer; the ledger "
        f"equal to every vmcache server's own pages, idle, after every fault "
        f"{f(s['ledger_agrees_after_every_fault'])}, at the end {f(s['final_agrees'])}, every "
        f"page back {f(s['pages_back_when_idle'])}: **{s['verdict']}**.\n\n"
    )
    table = md(["fault", "on", "what", "ledger = accounts", "settled in (s)", "failed requests"],
               rows)  # fmt: skip
    return head + table + "\n" + source(name, doc)


def _ab():
    return newest("ab-20??-??-??-*.json")


BLOCKS = {
    "fresh-clone": lambda: fresh_clone(*newest("fresh_clone-20??-??-??-*.json")),
    "ab-claims": lambda: ab_claims(*_ab()),
    "ab-enterprise": lambda: ab_capacity(*_ab()),
    "ab-forks": lambda: ab_forks(*_ab()),
    "ab-radix": lambda: ab_radix(*_ab()),
    "ab-rates": lambda: ab_rates(*_ab()),
    "ab-30k": lambda: ab_30k(*newest("ab-heavy30k-*.json")),
    "compute": lambda: compute(*_ab()),
    "kernels": lambda: kernels(*newest("bench_attention-*.json")),
    "vmm": lambda: vmm(*newest("bench_vmm-*.json")),
    "hf": lambda: hf(*newest("hf-*.json")),
    "window": lambda: window(*newest("window-*.json")),
    "handoff": lambda: handoff(*newest("handoff-*.json")),
    "elastic": lambda: elastic(*newest("elastic-*.json")),
    "multi": lambda: multi(*newest("multi-20??-??-??-*.json")),
    "multi-headline": lambda: multi_headline(*newest("multi-20??-??-??-*.json")),
    "vllm-kv": lambda: vllm_kv(*newest("vllm_kv-20??-??-??-*.json")),
    "chaos": lambda: chaos(*newest("chaos-20??-??-??-*.json")),
    "tiers": lambda: tiers(*newest("tiers-*.json")),
    "spec": lambda: spec(*newest("spec-*.json")),
    "quant": lambda: quant(*newest("quant-*.json")),
    "prefix-shapes": lambda: prefix_shapes(*newest("prefix_shapes-*.json")),
    "quant-ppl": lambda: quant_ppl(*newest("quant-*.json")),
    "spec-real": lambda: spec_real(*newest("spec_real-*.json")),
    "compute-real": lambda: compute_real(*_ab()),
    **SPEED_BLOCKS,
    **SERVER_BLOCKS,
    **LONG_BLOCKS,
}


def render(text: str, blocks: dict = BLOCKS) -> str:
    """``text`` with every generated block replaced by what the JSON says now."""

    def sub(m):
        name = m.group(2)
        if name not in blocks:
            raise KeyError(f"README block {name!r} has no renderer")
        return m.group(1) + blocks[name]() + m.group(4)

    return BLOCK.sub(sub, text)


def differing(text: str, blocks: dict = BLOCKS) -> list[str]:
    """The names of the blocks whose text differs from a fresh rendering."""
    want = {m.group(2): m.group(3) for m in BLOCK.finditer(render(text, blocks))}
    return [m.group(2) for m in BLOCK.finditer(text) if m.group(3) != want[m.group(2)]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    bad = []
    for path in DOCS:
        text = open(path).read()
        if args.check:
            for name in differing(text):
                bad.append(name)
                print(f"{os.path.relpath(path, ROOT)} block {name!r} differs from its JSON: "
                      "run scripts/render_readme.py")  # fmt: skip
            continue
        new = render(text)
        open(path, "w").write(new)
        print(f"{os.path.relpath(path, ROOT)}: rendered {len(BLOCK.findall(new))} blocks")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
