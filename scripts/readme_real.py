"""docs/results.md and README blocks measured on the trained model (SmolLM2-135M-Instruct):
K/V storage perplexity, speculation on real tasks, compute mode; used by
scripts/render_readme.py."""

from __future__ import annotations

from readme_format import f, md, source


def _ppl_rows(doc):
    return [r for r in doc["rows"] if r.get("kind") == "perplexity"]


def quant_ppl(name, doc) -> str:
    rows = _ppl_rows(doc)
    if not rows:
        return "*(no perplexity rows in this run: the embedded model was not cached)*\n"
    texts = list(dict.fromkeys(r["text"] for r in rows))
    by = {(r["text"], r["storage"]): r for r in rows}
    storages = list(dict.fromkeys(r["storage"] for r in rows))
    tokens = {t: next(r["tokens"] for r in rows if r["text"] == t) for t in texts}
    table = []
    for s in storages:
        cells = [s, by[texts[0], s].get("calibration", "–")]
        for t in texts:
            r = by.get((t, s), {})
            if "ppl" not in r:
                cells += [r.get("note", "–"), "–", "–"]
                continue
            cells += [r["ppl"], f"{100 * (r['ppl_vs_compute'] - 1):+.2f}%", r["top1_agreement"]]
        table.append(cells)
    head = ["storage", "calibration"]
    for t in texts:
        head += [f"ppl {t} ({tokens[t]:,} tok)", "vs compute", "top-1 = compute"]
    out = md(head, table)

    def worst(s):  # the larger perplexity increase over the texts
        return max(by[t, s]["ppl_vs_compute"] for t in texts if "ppl" in by.get((t, s), {}))

    have = [s for s in storages if all("ppl" in by.get((t, s), {}) for t in texts)]
    e4_default = next((s for s in have if s.startswith("fp8 e4m3, calibrated (default)")), None)
    e4_unit = next((s for s in have if s.startswith("fp8 e4m3, unit")), None)
    int8_head = [s for s in have if s.startswith("int8, calibrated")]
    int8_default = next((s for s in int8_head if "default" in s), None)
    checks = []
    if e4_default and e4_unit:
        ok = all(by[t, e4_default]["ppl"] <= by[t, e4_unit]["ppl"] * 1.001 for t in texts)
        checks.append(f"FP8 e4m3's default calibration is no worse than unit scales on both "
                      f"texts: {'holds' if ok else 'DIFFERS'}")  # fmt: skip
        fitted = [s for s in have if s.startswith("fp8 e4m3, calibrated, range fitted")]
        if fitted:
            hurt = all(worst(s) > worst(e4_unit) for s in fitted)
            checks.append(f"fitting e4m3's range to the calibration's amax costs perplexity "
                          f"at every margin tried: {'holds' if hurt else 'DIFFERS'}")  # fmt: skip
    if int8_default and int8_head:
        best = min(int8_head, key=worst)
        said = "holds" if best == int8_default else f"DIFFERS: {best} is"
        checks.append(f"INT8's default calibration is the best of its head-scale rows "
                      f"({said})")  # fmt: skip
    one_byte = [s for s in have if s.startswith(("fp8", "int8"))]
    best1 = min(one_byte, key=worst) if one_byte else None
    if best1:
        checks.append(f"the best one-byte storage is {best1} (at most "
                      f"{100 * (worst(best1) - 1):+.2f}% perplexity)")  # fmt: skip
    verdict = "Verdict: " + "; ".join(checks) + "." if checks else ""
    return out + "\n" + verdict + "\n\n" + source(name, doc)


def spec_real(name, doc) -> str:
    rows = doc["rows"]

    def wall(r):
        return f"{f(r['wall_s'])} ({f(r['wall_s_min'])}–{f(r['wall_s_max'])})"

    out = md(["workload", "speculation", "engine steps", "tokens a step (batch)", "proposed",
              "accepted", "acceptance", "tokens a verification", "answers = none",
              "wall s (min–max)", "wall / none"],
             [[r["workload"], r["speculation"], r["steps"], r["tokens_per_step"],
               r["spec_proposed"], r["spec_accepted"], "–" if r["acceptance"] is None
               else r["acceptance"], "–" if r["tokens_per_verify"] is None
               else r["tokens_per_verify"], r["answers_equal_none"], wall(r),
               r["wall_vs_none"]] for r in rows])  # fmt: skip
    by = {(r["workload"], r["speculation"]): r for r in rows}
    same = all(r["answers_equal_none"] for r in rows)
    chain = by.get(("quoting", "ngram k=4"))
    chain_open = by.get(("open", "ngram k=4"))
    drafts = [r for r in rows if r["speculation"].startswith("draft")]
    parts = [f"every answer equals the run without speculation: {'holds' if same else 'DIFFERS'}"]
    if chain and chain_open:
        parts.append(
            f"prompt lookup takes fewer target steps where answers quote the prompt "
            f"({chain['steps']} vs {by['quoting', 'none']['steps']}, acceptance "
            f"{f(chain['acceptance'])}, wall {f(chain['wall_vs_none'])}x) than on open "
            f"questions ({chain_open['steps']} vs {by['open', 'none']['steps']}, acceptance "
            f"{f(chain_open['acceptance'])}, wall {f(chain_open['wall_vs_none'])}x): "
            f"{'holds' if chain['steps'] < by['quoting', 'none']['steps'] else 'DIFFERS'}"
        )
    for r in drafts:
        parts.append(f"the truncated draft model on {r['workload']} tasks: acceptance "
                     f"{f(r['acceptance'])}, wall {f(r['wall_vs_none'])}x")  # fmt: skip
    verdict = "Verdict: " + "; ".join(parts) + "."
    return out + "\n" + verdict + "\n\n" + source(name, doc)


def _mm(r, key, scale=1.0):
    return f"{f(r[key] * scale)} ({f(r[key + '_min'] * scale)}–{f(r[key + '_max'] * scale)})"


def compute_real(name, doc) -> str:
    rows = [r for r in doc["rows"] if r.get("mode") == "compute_real"]
    if not rows:
        return "*(no real-model rows in this run: the embedded model was not cached)*\n"
    served = [r for r in rows if "prefill" in r]
    out = md(["cache", "prefill", "req/s", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
              "TPOT p50 ms", "TPOT p99 ms", "vm / paged tok/s", "spread", "same answers"],
             [[r["cache"], r["prefill"], r["rate_rps"], _mm(r, "tok_per_s"),
               _mm(r, "ttft_p50_s", 1e3), _mm(r, "ttft_p99_s", 1e3), _mm(r, "tpot_p50_s", 1e3),
               _mm(r, "tpot_p99_s", 1e3), r["vm_vs_paged_tok_per_s"], r["spread_note"],
               r["answers_equal_across_caches"]] for r in served])  # fmt: skip
    shared = [r for r in rows if r.get("scenario") == "shared_system_prompt"]
    out += "\n" + md(["cache", "prefix caching", "prompt tokens", "computed", "from the cache",
                      "tokens/s (one run)", "same answers"],
                     [[r["cache"], r["prefix_caching"], r["prompt_tokens"], r["prefill_tokens"],
                       r["prefix_hit_tokens"], r["tok_per_s"], r["answers_equal_without_prefix"]]
                      for r in shared])  # fmt: skip
    hits = {r["cache"]: r for r in shared if r["prefix_caching"]}
    same = all(r["answers_equal_across_caches"] for r in served) and all(
        r["answers_equal_without_prefix"] for r in shared
    )
    verdict = (
        f"Verdict: both caches give the same answers, with and without prefix caching: "
        f"{'holds' if same else 'DIFFERS'}; prefix caching serves "
        + ", ".join(
            f"{k} {r['prefix_hit_tokens']:,} of {r['prompt_tokens']:,} prompt tokens"
            for k, r in hits.items()
        )
        + " from the cache"
        + (
            " (VMKVCache's whole-token blocks are coarser than paged's 16 tokens: the cost of "
            "sharing a 768-byte row)."
            if hits.get("vmcache", {}).get("prefix_hit_tokens", 0)
            < hits.get("paged", {}).get("prefix_hit_tokens", 0)
            else " (the same: the shared prefix rounds down to the same whole blocks on both here; "
            "VMKVCache's blocks are 256 tokens for this 768-byte row, paged's 16)."
        )
    )
    return out + "\n" + verdict + "\n\n" + source(name, doc)
