"""The seed's claims beside the measurements, a verdict per row, and the plots."""

from __future__ import annotations

from pathlib import Path

from ..spec import KVSpec

# (trace, allocator family) -> what the seed claims there
CLAIMS = {
    ("enterprise", "static"): "waste > 70 %",
    ("enterprise", "paged"): "B=16: ~7.5 tokens/seq, < 4 % waste",
    ("parallel", "paged"): "CoW saving up to 55 %, up to 2.2x concurrency",
    ("beam", "paged"): "CoW saving up to 55 %, up to 2.2x concurrency",
    ("enterprise", "vm"): "<= 1 page per (layer, K/V) row",
    ("long", "vm"): "<= 1 page per (layer, K/V) row",
    ("shared", "radix"): "RadixAttention: shared prefix computed and stored once",
    ("multiturn", "radix"): "RadixAttention: history computed and stored once",
}


def _tokens_per_page(spec: KVSpec, allocator: str) -> float:
    _, layout, size = allocator.split("-")
    page = (2 << 20) if size == "2M" else (64 << 10)
    per_token = spec.bytes_per_token_per_layer  # one of K or V, one layer
    return page / (per_token * (spec.num_layers if layout == "token" else 1))


def verdicts(rows: list[dict]) -> None:
    """Adds ``verdict`` to rows that have a numeric claim: agrees / DIFFERS, with the figure."""
    static = {r["trace"]: r for r in rows if r["allocator"] == "static" and "steps" in r}
    by_name = {(r["trace"], r["allocator"]): r for r in rows if "steps" in r}
    for r in rows:
        claim, name, trace = r.get("seed_claim"), r["allocator"], r["trace"]
        if not claim or "steps" not in r:
            r["verdict"] = r.get("note", "")[:13]
            continue
        if name.startswith("radix-"):
            twin = by_name.get((trace, name.removeprefix("radix-")))
            if twin is None:
                r["verdict"] = ""
                continue
            saved = 1 - r["prefill_tokens"] / max(twin["prefill_tokens"], 1)
            gain = r["max_concurrent_seqs"] / max(twin["max_concurrent_seqs"], 1)
            r["verdict"] = f"prefill -{saved:.0%}, {gain:.1f}x seqs vs no reuse"
        elif name == "static":
            ok = r["reservation_waste_pct"] > 70
            r["verdict"] = f"{'agrees' if ok else 'DIFFERS'} ({r['reservation_waste_pct']:.0f} %)"
        elif name == "paged-16" and trace == "enterprise":
            ok = r["internal_waste_pct"] < 4 and 5 <= r["waste_tokens_per_seq"] <= 10
            r["verdict"] = (f"{'agrees' if ok else 'DIFFERS'} ({r['waste_tokens_per_seq']:.1f} tok,"
                            f" {r['internal_waste_pct']:.1f} %)")  # fmt: skip
        elif name.startswith("paged") and trace in ("parallel", "beam"):
            gain = r["max_concurrent_seqs"] / max(static[trace]["max_concurrent_seqs"], 1)
            within = "within" if r["cow_saving_pct"] <= 55 else "beyond"
            r["verdict"] = f"{r['cow_saving_pct']:.0f} % saved ({within} claim), {gain:.1f}x seqs"
        elif name.startswith("vm"):
            bound = _tokens_per_page(KVSpec.preset(r["model"]), name)
            ok = r["waste_tokens_per_seq"] <= bound
            r["verdict"] = (f"{'agrees' if ok else 'DIFFERS'} ({r['waste_tokens_per_seq']:.0f} "
                            f"<= {bound:.0f} tok)")  # fmt: skip
        else:
            r["verdict"] = ""


def plot(sizing: list[dict], compute: list[dict], json_path: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    done = [r for r in sizing if "steps" in r]
    tnames = list(dict.fromkeys(r["trace"] for r in done))
    if done:
        for key, title, suffix in (("waste", "KV waste by allocator (%)", "waste"),
                                   ("max_concurrent_seqs", "max concurrent sequences",
                                    "concurrency")):  # fmt: skip
            fig, axes = plt.subplots(1, len(tnames), figsize=(4 * len(tnames), 4), squeeze=False)
            for ax, t in zip(axes[0], tnames):
                rs = [r for r in done if r["trace"] == t]
                xs = range(len(rs))
                if key == "waste":
                    inner = [r["internal_waste_pct"] for r in rs]
                    ax.bar(xs, inner, label="internal")
                    ax.bar(xs, [r["reservation_waste_pct"] for r in rs], bottom=inner,
                           label="reservation")  # fmt: skip
                else:
                    ax.bar(xs, [r[key] for r in rs])
                ax.set_xticks(list(xs), [r["allocator"] for r in rs], rotation=70, fontsize=7)
                ax.set_title(t)
            axes[0][0].set_ylabel(title)
            if key == "waste":
                axes[0][0].legend()
            fig.tight_layout()
            p = json_path.with_name(f"{json_path.stem}-{suffix}.png")
            fig.savefig(p, dpi=100)
            plt.close(fig)
            out.append(p)
    compute = [r for r in compute if "budget_requests" in r]
    if compute:
        fig, ax = plt.subplots(figsize=(5, 4))
        for kind in ("vmcache", "paged"):
            rs = [r for r in compute if r["cache"] == kind]
            ax.plot([r["budget_requests"] for r in rs], [r["tok_per_s"] for r in rs], "o-",
                    label=kind)  # fmt: skip
        ax.set_xlabel("KV budget (longest requests the VM cache holds)")
        ax.set_ylabel("tokens/s")
        ax.set_title("engine throughput vs memory budget")
        ax.legend()
        fig.tight_layout()
        p = json_path.with_name(f"{json_path.stem}-throughput.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        out.append(p)
    return out
