"""The seed's claims beside the measurements, a verdict per row, and the plots."""

from __future__ import annotations

from pathlib import Path

from vmcache.sequences.spec import KVSpec

# (trace, allocator family) -> what the seed claims there; how each is tested: verdicts()
CLAIMS = {
    ("enterprise", "static"): "waste > 70 %",
    ("enterprise", "paged"): "waste only in each sequence's last block (< B tok), < 4 %",
    ("heavy", "paged"): "waste only in each sequence's last block (< B tok), < 4 %",
    ("parallel", "paged"): "CoW saves up to 55 % of KV; up to 2.2x throughput from sharing",
    ("beam", "paged"): "CoW saves up to 55 % of KV; up to 2.2x throughput from sharing",
    ("enterprise", "vm"): "< 1 page of waste per (layer, K/V) row per sequence",
    ("long", "vm"): "< 1 page of waste per (layer, K/V) row per sequence",
    ("heavy", "vm"): "< 1 page of waste per (layer, K/V) row per sequence",
    ("shared", "radix"): "shared prefix computed once",
    ("multiturn", "radix"): "shared history computed once",
}
UP_TO = 0.2  # an "up to X" claim agrees when the measurement is within ±20 % of X


def family(allocator: str) -> str:
    if allocator.startswith("radix-"):
        return "radix"
    return "copy" if allocator.endswith("-copy") else allocator.split("-")[0]


def row_tokens_per_page(spec: KVSpec, allocator: str) -> float:
    """Tokens one page of one (layer, K/V) row holds (token_major: a row is every layer)."""
    _, layout, size = allocator.removeprefix("radix-").removesuffix("-copy").split("-")
    page = (2 << 20) if size == "2M" else (64 << 10)
    per_token = spec.bytes_per_token_per_layer  # one of K or V, one layer
    return page / (per_token * (spec.num_layers if layout == "token" else 1))


def unique_prompt_tokens(trace) -> int:
    """Distinct prompt prefixes over the trace (nodes of a trie of the prompts' token ids):
    the prompt tokens an ideal prefix cache computes once each."""
    from vmcache.bench.traces import token_id

    nodes: dict[tuple[int, int], int] = {}
    for rid, r in enumerate(trace):
        node = 0
        for p in range(r.prompt_len):
            node = nodes.setdefault((node, token_id(r, rid, p)), len(nodes) + 1)
    return len(nodes)


def _up_to(measured: float, claimed: float) -> bool:
    return abs(measured - claimed) <= UP_TO * claimed


def _verdict(ok: bool, detail: str) -> str:
    return f"{'agrees' if ok else 'DIFFERS'} ({detail})"


def verdicts(rows: list[dict], unique: dict | None = None) -> None:
    """Adds ``verdict`` to rows with a claim; each test could read DIFFERS:
      static      reservation waste > 70 %
      paged-B     every sequence's worst waste < B tokens, and internal waste < 4 %
      vm-*        every sequence's worst waste < one page of a row (tokens)
      parallel /  CoW saving ±20 % of 55 %; tokens per modelled second ±20 % of 2.2x the same
      beam        cache with copying forks (``-copy`` twin); "memory not binding" when neither
      radix-*     prompt tokens computed <= unique prompt tokens (``unique``: trace -> count)
                  + one page per request (partial pages are not cached) + the prompt
                  tokens computed again after a preemption (not a failure of the cache)
    A row whose memory never bound (all admitted, nothing preempted) says so."""
    twins = {(r["trace"], r.get("rate_rps"), r["allocator"]): r for r in rows if "steps" in r}
    for r in rows:
        fam, name, trace = family(r["allocator"]), r["allocator"], r["trace"]
        r["seed_claim"] = CLAIMS.get((trace, fam), "")
        if "steps" not in r:
            r["verdict"] = r.get("note", "")[:40]
            continue
        flag = "" if r["memory_binding"] else f"; all {r['requests']} admitted, memory not binding"
        if not r["seed_claim"]:
            r["verdict"] = flag.removeprefix("; ")
            continue
        worst = r["seq_waste_max_tok"]
        if fam == "static":
            w = r["reservation_waste_pct"]
            r["verdict"] = _verdict(w > 70, f"{w:.0f} %")
        elif fam == "paged" and trace in ("parallel", "beam"):
            twin = twins.get((trace, r.get("rate_rps"), name + "-copy"))
            save = r["cow_saving_pct"]
            if twin is None:
                r["verdict"] = f"saves {save:.0f} % (no -copy twin run for throughput)"
                continue
            gain = r["tokens_per_modelled_s"] / max(twin["tokens_per_modelled_s"], 1e-12)
            ok = _up_to(save, 55) and _up_to(gain, 2.2)
            binding = r["memory_binding"] or twin["memory_binding"]
            r["verdict"] = _verdict(ok, f"saves {save:.0f} %, {gain:.2f}x tok/s vs copying forks"
                                    + ("" if binding else "; memory not binding"))  # fmt: skip
            continue
        elif fam == "paged":
            b = int(name.split("-")[1])
            ok = worst < b and r["internal_waste_pct"] < 4
            r["verdict"] = _verdict(ok, f"worst {worst:.0f} < {b} tok, "
                                    f"{r['internal_waste_pct']:.1f} %")  # fmt: skip
        elif fam == "vm":
            bound = row_tokens_per_page(KVSpec.preset(r["model"]), name)
            r["verdict"] = _verdict(worst < bound, f"worst {worst:.0f} < {bound:.0f} tok")
        elif fam == "radix":
            twin = twins.get((trace, r.get("rate_rps"), name.removeprefix("radix-")))
            ideal = (unique or {}).get(trace)
            page = (int(name.split("-")[2]) if "paged" in name
                    else row_tokens_per_page(KVSpec.preset(r["model"]), name))  # fmt: skip
            if ideal is None:
                r["verdict"] = ""
                continue
            bound = ideal + r["requests"] * page + r["reprefill_tokens"]
            saved = (f", -{1 - r['prefill_tokens'] / max(twin['prefill_tokens'], 1):.0%} vs no "
                     "reuse" if twin else "")  # fmt: skip
            detail = f"{r['prefill_tokens']:,} computed, bound {bound:,.0f}{saved}"
            r["verdict"] = _verdict(r["prefill_tokens"] <= bound, detail)
        r["verdict"] += flag


def _footer(fig, doc: dict) -> None:
    sha = (doc.get("git_sha") or "unknown")[:10] + ("+dirty" if doc.get("git_dirty") else "")
    fig.text(0.01, 0.005, f"{doc.get('date', '')} · {doc.get('device', '')} · commit {sha}",
             fontsize=7, color="0.35")  # fmt: skip


def plot(rows: list[dict], json_path: Path) -> list[Path]:
    """Waste per allocator (value labels: small bars stay readable), modelled TTFT / TPOT
    against request rate, compute-mode latency against rate (median, min–max bars); each
    with the date, device and commit of the JSON beside it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    import json

    doc = json.loads(Path(json_path).read_text())
    out = []

    def save(fig, suffix):
        _footer(fig, doc)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        p = json_path.with_name(f"{json_path.stem}-{suffix}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        out.append(p)

    cap = [r for r in rows if "steps" in r and r.get("rate_rps") is None and "mode" not in r]
    tnames = list(dict.fromkeys(r["trace"] for r in cap))
    if cap:
        fig, axes = plt.subplots(len(tnames), 1, figsize=(9, 2.6 * len(tnames)), squeeze=False)
        for ax, t in zip(axes[:, 0], tnames):
            rs = [r for r in cap if r["trace"] == t]
            xs = list(range(len(rs)))
            inner = [r["internal_waste_pct"] for r in rs]
            resv = [r["reservation_waste_pct"] for r in rs]
            ax.bar(xs, inner, label="internal")
            bars = ax.bar(xs, resv, bottom=inner, label="reservation")
            ax.bar_label(bars, [f"{a + b:.2g} %" for a, b in zip(inner, resv)], fontsize=7)
            ax.set_yscale("symlog", linthresh=1)
            ax.set_ylim(0, 300)
            ax.set_xticks(xs, [r["allocator"] for r in rs], rotation=20, fontsize=7)
            ax.set_ylabel(f"{t}: waste %", fontsize=8)
        axes[0, 0].legend(fontsize=7)
        axes[0, 0].set_title("KV waste by allocator (symlog axis; labels: internal + reservation)")
        save(fig, "waste")
    swept = [r for r in rows if "steps" in r and r.get("rate_rps") is not None
             and "mode" not in r]  # fmt: skip
    if swept:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for a in dict.fromkeys(r["allocator"] for r in swept):
            rs = sorted((r for r in swept if r["allocator"] == a), key=lambda r: r["rate_rps"])
            xs = [r["rate_rps"] for r in rs]
            axes[0].plot(xs, [r["model_ttft_p99_s"] for r in rs], "o-", label=a)
            axes[1].plot(xs, [r["model_tpot_p99_s"] * 1e3 for r in rs], "o-", label=a)
        axes[0].set(xlabel="request rate (req/s)", ylabel="TTFT p99 (modelled s)", yscale="log")
        axes[1].set(xlabel="request rate (req/s)", ylabel="TPOT p99 (modelled ms)")
        axes[0].legend(fontsize=6)
        fig.suptitle("sizing mode, heavy-tailed trace: modelled latency vs load", fontsize=9)
        save(fig, "latency")
    comp = [r for r in rows if r.get("mode") == "compute" and "rate_rps" in r]
    if comp:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for kind in ("vmcache", "paged"):
            rs = sorted((r for r in comp if r["cache"] == kind), key=lambda r: r["rate_rps"])
            xs = [r["rate_rps"] for r in rs]
            for ax, key, scale in ((axes[0], "ttft_p50_s", 1e3), (axes[1], "tpot_p50_s", 1e3)):
                mid = [r[key] * scale for r in rs]
                lo = [m - r[key + "_min"] * scale for m, r in zip(mid, rs)]
                hi = [r[key + "_max"] * scale - m for m, r in zip(mid, rs)]
                ax.errorbar(xs, mid, yerr=[lo, hi], fmt="o-", capsize=3, label=kind)
        axes[0].set(xlabel="request rate (req/s)", ylabel="TTFT p50 (ms, measured)", xscale="log")
        axes[1].set(xlabel="request rate (req/s)", ylabel="TPOT p50 (ms, measured)", xscale="log")
        axes[0].legend(fontsize=7)
        fig.suptitle("compute mode: median of repeats, bars = min–max", fontsize=9)
        save(fig, "compute")
    return out
