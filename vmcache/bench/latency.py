"""Time in the harness: the modelled step time of sizing mode, and the latency figures both
modes report (TTFT, TPOT, end-to-end: p50 / p90 / p99; goodput under an SLO).

    arrival        first token            finish
       |---- TTFT ----|------ (output − 1) × TPOT ------|
       |------------------- end-to-end -----------------|

Sizing mode runs no model, so its clock advances by :class:`StepModel`: a fixed cost per
step, a cost per prompt token computed, per decoding sequence, and the time to read every
running sequence's K/V once. Its latencies are *modelled* seconds and are labelled so.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class StepModel:
    """Modelled duration of one engine step. The defaults are round figures of the right
    order for an 8B model on one H100-class GPU (weights read once per step, prefill at ~20k
    tokens/s, HBM at 2.5 TB/s); they are a model, not a measurement."""

    fixed_ms: float = 6.0
    prefill_us_per_token: float = 50.0
    decode_us_per_seq: float = 30.0
    kv_GB_per_s: float = 2500.0

    def seconds(self, prefill_tokens: int, decode_seqs: int, kv_bytes: int) -> float:
        return (1e-3 * self.fixed_ms + 1e-6 * self.prefill_us_per_token * prefill_tokens
                + 1e-6 * self.decode_us_per_seq * decode_seqs
                + kv_bytes / (1e9 * self.kv_GB_per_s))  # fmt: skip


@dataclass(frozen=True)
class SLO:
    """A request counts toward goodput if it meets both bounds."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (s) of a Poisson process at ``rate`` requests/s."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng, t, out = random.Random(f"poisson-{seed}"), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0–100), linear between order statistics; nan if empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(records: list[tuple[float, float, float, int]], slo: SLO = SLO()) -> dict:
    """``records``: (arrival_s, first_token_s, finish_s, output_tokens) per request →
    p50/p90/p99 of TTFT, TPOT and end-to-end latency (s), goodput (requests/s meeting the
    SLO) and the span from the first arrival to the last finish."""
    if not records:
        return {}
    ttft = [f - a for a, f, _, _ in records]
    tpot = [(e - f) / (n - 1) for _, f, e, n in records if n > 1]
    e2e = [e - a for a, _, e, _ in records]
    span = max(e for _, _, e, _ in records) - min(a for a, _, _, _ in records)
    good = sum(1 for a, f, e, n in records
               if f - a <= slo.ttft_s and (n <= 1 or (e - f) / (n - 1) <= slo.tpot_s))  # fmt: skip
    out = {}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(xs, q)
    out.update(span_s=span, goodput_rps=good / span if span > 0 else float("nan"),
               slo_met_pct=100 * good / len(records))  # fmt: skip
    return out


def spread(values: list[float]) -> dict:
    """Median, min and max of repeats (the harness's one way to report a repeated figure)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}  # fmt: skip


def compare_tok_per_s(vm: dict, paged: dict, repeats: int) -> None:
    """Set both rows' ``vm_vs_paged_tok_per_s`` (medians' ratio) and ``spread_note``: whether
    the repeats' own spread (the wider of the two, relative) could explain that ratio."""
    ratio = vm["tok_per_s"] / paged["tok_per_s"]
    noise = max((r["tok_per_s_max"] - r["tok_per_s_min"]) / r["tok_per_s"] for r in (vm, paged))
    note = ("one run: no spread" if repeats < 2 else "spread > effect"
            if noise > abs(ratio - 1) else "effect > spread")  # fmt: skip
    for r in (vm, paged):
        r["vm_vs_paged_tok_per_s"], r["spread_note"] = ratio, note
