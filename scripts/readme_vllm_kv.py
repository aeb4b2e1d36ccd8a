"""docs/results.md's block for vLLM with and without vmcache underneath
(benchmarks/bench_vllm_kv.py's JSON), used by scripts/render_readme.py; run as a script it
draws the JSON's memory plot beside it::

    python scripts/readme_vllm_kv.py benchmarks/results/vllm_kv-DATE-cpu-*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from readme_format import f, md, source

IDLE_MAX = 0.10  # the claim: idle KV at most a tenth of the space,
SPEED_MIN = 0.95  # decode tokens/s at least this of vLLM's own


def _rows(doc) -> dict:
    return {r["system"]: r for r in doc["rows"]}


def verdict(doc) -> tuple[bool, dict]:
    r, space = _rows(doc), doc["space_mib"]
    kv_idle = r["vmcache"]["idle_shmem_mib"]
    held = r["vllm"]["idle_anon_mib"] - r["vmcache"]["idle_anon_mib"]
    speed = r["vmcache"]["tok_per_s"] / r["vllm"]["tok_per_s"]
    checks = {"kv_idle_fraction": kv_idle / space, "vllm_holds_mib": held, "speed_ratio": speed,
              "tokens_equal": all(doc["tokens_equal"].values())}  # fmt: skip
    holds = (kv_idle <= IDLE_MAX * space and speed >= SPEED_MIN and checks["tokens_equal"]
             and r["vmcache"]["after_rss_mib"] < r["vmcache"]["peak_rss_mib"])  # fmt: skip
    return holds, checks


def vllm_kv(name, doc) -> str:
    r, space = _rows(doc), doc["space_mib"]
    table = md(["", "start-up (s)", "idle RSS (MiB)", "of it KV (MiB)", "burst peak RSS (MiB)",
                f"{f(doc['args']['idle_s'] * 1)} s after (MiB)", "decode tokens/s (min–max)"],
               [[k, f(x["startup_s"]), f(x["idle_rss_mib"]),
                 f(x["idle_shmem_mib"]) if k == "vmcache" else f"all {space}",
                 f(x["peak_rss_mib"]), f(x["after_rss_mib"]),
                 f"{f(x['tok_per_s'])} ({f(x['tok_per_s_min'])}–{f(x['tok_per_s_max'])})"]
                for k, x in r.items()])  # fmt: skip
    holds, c = verdict(doc)
    a = doc["args"]
    intro = (
        f"vLLM {doc['vllm']} (CPU build) on SmolLM2-135M-Instruct in fp32 with a "
        f"{space} MiB KV space, alone and with `--worker-cls`/`--scheduler-cls` of "
        f"`vmcache.vllm` (prefix caching on, {f(a['prefix_cache_mib'])} MiB of cached blocks "
        f"kept resident), both up side by side: a burst of {a['burst']} requests of 256 new "
        f"tokens, then {a['repeats']} alternating rounds of {a['decode']} requests of 128 "
        f"({doc['vllm_note']}).\n\n"
    )
    claim = (
        f"Claim: with vmcache the idle KV memory is at most {IDLE_MAX:.0%} of the space, it "
        f"falls after a burst, decode keeps at least {SPEED_MIN}× vLLM's tokens/s, tokens "
        f"equal. Measured: idle KV {c['kv_idle_fraction']:.1%} of the space (vLLM alone holds "
        f"{f(c['vllm_holds_mib'])} MiB more from start), decode {c['speed_ratio']:.3f}×, tokens "
        f"equal {f(c['tokens_equal'])}: **{'AGREES' if holds else 'DIFFERS'}**. Plot: "
        f"`benchmarks/results/{Path(name).stem}.png`.\n"
    )
    return intro + table + "\n" + claim + "\n" + source(name, doc)


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for k, tl in doc["timeline"].items():
        s = tl["samples"]
        start = tl["burst_start_s"]
        ax.plot([x[0] - start for x in s], [x[1] + x[2] for x in s], label=f"{k}: RSS")
        if k == "vmcache":
            ax.plot([x[0] - start for x in s], [x[2] for x in s], "--", label=f"{k}: of it KV")
        ax.axvline(tl["burst_end_s"] - start, color="grey", lw=0.5)
    ax.axvline(0, color="grey", lw=0.5)
    ax.set_xlabel("seconds from the burst's start (grey: its start and each one's end)")
    ax.set_ylabel("model process resident MiB")
    ax.set_title(f"vLLM {doc['vllm']} CPU, {doc['space_mib']} MiB KV space: with and without "
                 "vmcache", fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
