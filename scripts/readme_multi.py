"""README and docs/results.md blocks of several models on one KV budget against a static split
(benchmarks/bench_multi.py's JSON); used by scripts/render_readme.py."""

from __future__ import annotations

from readme_format import f, md, source

MODELS = ("m0", "m1", "m2")


def _ratio(s: dict) -> str:
    return f"{s['p99_ratio']:.2f}× ({s['p99_ratio_min']:.2f}–{s['p99_ratio_max']:.2f})"


def _equal(doc, peak: int) -> tuple[int, int]:
    runs = [v for k, v in doc["tokens_equal"].items() if int(k.split("/")[0]) == peak]
    return sum(runs), len(runs) * next(s["requests"] for s in doc["summary"] if s["peak"] == peak)


def _bound(doc) -> list[dict]:
    """The P where memory binds the static split: where its p99 is at least twice its own at
    the smallest P (8 + 8 tokens a request are little compute, and a third of the budget holds
    2 sequences: its queueing starts there)."""
    summ = doc["summary"]
    return [s for s in summ if s["static_ttft_p99_s"] >= 2 * summ[0]["static_ttft_p99_s"]]


def _verdict(doc) -> tuple[list[dict], bool]:
    """The claim where memory binds: static p99 >= 2x shared's at every such P."""
    bound = _bound(doc)
    return bound, bool(bound) and all(s["p99_ratio"] >= 2.0 for s in bound)


def multi(name, doc) -> str:
    kv, summ = doc["kv"], doc["summary"]
    mib = lambda b: f(b / 2**20)  # noqa: E731
    intro = (
        f"One sequence ({kv['tokens_a_sequence']} tokens) maps {mib(kv['sequence_bytes'])} MiB; "
        f"a third of the {f(doc['args']['budget_mib'])} MiB budget holds "
        f"{kv['sequences_in_a_third']} sequences, the whole budget "
        f"{kv['sequences_in_the_budget']} (each model's floor: {mib(kv['floor_bytes'])} MiB).\n\n"
    )
    table = md(["P", "requests", "TTFT p99 static / shared (s)", "ratio (min–max)",
                "TTFT mean static / shared (s)", "tokens/s static / shared",
                "preemptions static / shared", "tokens equal"],
               [[s["peak"], s["requests"],
                 f"{f(s['static_ttft_p99_s'])} / {f(s['shared_ttft_p99_s'])}", _ratio(s),
                 f"{f(s['static_ttft_mean_s'])} / {f(s['shared_ttft_mean_s'])}",
                 f"{f(s['static_tok_per_s'])} / {f(s['shared_tok_per_s'])}",
                 f"{f(s['static_preemptions'])} / {f(s['shared_preemptions'])}",
                 "{} / {}".format(*_equal(doc, s["peak"]))]
                for s in summ])  # fmt: skip
    per_model = md(["P", *[f"{m} p99 static / shared (s)" for m in MODELS]],
                   [[s["peak"], *[f"{f(s[f'static_{m}_ttft_p99_s'])} / "
                                  f"{f(s[f'shared_{m}_ttft_p99_s'])}" for m in MODELS]]
                    for s in summ])  # fmt: skip
    bound, holds = _verdict(doc)
    top, cap = summ[-1], doc["capacity_peak"]
    at = "; ".join(f"P = {s['peak']}: {_ratio(s)}" for s in bound) or "no P"
    below = [s for s in summ if s not in bound]
    faster = ", ".join(f"{1 / s['p99_ratio']:.2f}×" for s in below)
    verdict = (
        f"Claim (kvcached's headline, scaled): where memory binds the static split (its p99 at "
        f"least twice its own at P = {summ[0]['peak']}), its p99 TTFT is at least 2× the "
        f"shared budget's. Measured: {at}: **{'AGREES' if holds else 'DIFFERS'}**. Below "
        f"that ({', '.join(str(s['peak']) for s in below) or 'none'}), where a third holds "
        f"the peak, the static split is the faster by "
        f"{faster or '–'} "
        f"(one process's three engine threads and its HTTP work against three processes'). "
        f"Capacity: the shared budget "
        f"keeps its p99 at or below the static split's p99 at P = {top['peak']} "
        f"({f(doc['capacity_base_p99_s'])} s) up to P = {cap if cap is not None else '–'}"
        f"{' (the largest P measured)' if cap == top['peak'] else ''}.\n"
    )
    st = doc["stall"]
    stall = (
        f"One model's compute against another's requests (the design: one process, an engine "
        f"thread a model): m1's median TTFT for short requests while m0 decodes 4 long ones "
        f"is {f(st['shared']['m1_ttft_loaded_median_s'])} s in the shared server (idle "
        f"{f(st['shared']['m1_ttft_idle_median_s'])} s) against "
        f"{f(st['static']['m1_ttft_loaded_median_s'])} s with separate processes (idle "
        f"{f(st['static']['m1_ttft_idle_median_s'])} s); p90 "
        f"{f(st['shared']['m1_ttft_loaded_p90_s'])} against "
        f"{f(st['static']['m1_ttft_loaded_p90_s'])} s.\n"
    )
    return (
        intro + table + "\n" + per_model + "\n" + verdict + "\n" + stall + "\n" + source(name, doc)
    )


def multi_headline(name, doc) -> str:
    bound, holds = _verdict(doc)
    top = bound[-1] if bound else doc["summary"][-1]
    return (
        f"Three models on one KV budget against a static split in thirds, kvcached's staggered "
        f"peaks at P = {top['peak']} requests/s: p99 TTFT {f(top['shared_ttft_p99_s'])} s "
        f"against {f(top['static_ttft_p99_s'])} s ({_ratio(top)} lower; "
        f"{'AGREES' if holds else 'DIFFERS'} with the 2× claim where memory binds; `make "
        f"bench-multi`, {doc['date']}, {doc['device']}).\n"
    )
