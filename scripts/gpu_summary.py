"""Summarise one GPU check: every GPU claim of docs/results.md with its measured value and a
verdict (agrees | DIFFERS | not measured), from the files scripts/gpu_check.sh left in OUT.

    python scripts/gpu_summary.py OUT            writes OUT/summary.json, prints a table
    python scripts/gpu_summary.py --readme FILE  prints docs/results.md's GPU section rendered
                                                 from FILE (a summary.json), or from nothing
    python scripts/gpu_summary.py --compile-table benchmarks/results/compile_sm90.json

The summary is the only input of docs/results.md's GPU section (tests/gpu/test_gpu_check.py checks
docs/results.md against the committed one, or against the "not measured yet" rendering).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import xml.etree.ElementTree as ET


def _rows(out: str, prefix: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(out, f"{prefix}-*.json")))
    return json.load(open(paths[-1]))["rows"] if paths else []


def _junit(out):
    """The GPU tests' junit root, or None where the step wrote none."""
    path = os.path.join(out, "gpu-tests.xml")
    return ET.parse(path).getroot() if os.path.exists(path) else None


def _tests(out):
    root = _junit(out)
    if root is None:
        return None, "no junit file"
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    value = f"{n['tests']} run, {n['failures'] + n['errors']} failed, {n['skipped']} skipped"
    ok = n["tests"] > 0 and n["failures"] == n["errors"] == n["skipped"] == 0
    return ok, value


def _graph(out):
    """The CUDA-graph test's own verdict in the junit file (tests/gpu/test_cuda_graphs.py)."""
    root = _junit(out)
    if root is None:
        return None, "no junit file"
    cases = [c for c in root.iter("testcase")
             if c.get("classname", "").endswith("test_cuda_graphs")]  # fmt: skip
    if not cases or any(c.find("skipped") is not None for c in cases):
        return None, "the test did not run"
    failed = sum(c.find("failure") is not None or c.find("error") is not None for c in cases)
    return failed == 0, f"{len(cases)} run, {failed} failed"


def _syncs(out):
    rows = _rows(out, "syncs")
    if not rows:
        return None, "no syncs JSON"
    up = max(r["plan_uploads_per_step"] for r in rows)
    sy = max(r["backend_syncs_per_step"] for r in rows)
    return up <= 1 and sy == 0, f"max {up:g} plan uploads, {sy:g} cache syncs per step"


def _attention(out):
    ratios = [r["vs_plain"] for r in _rows(out, "bench_attention") if "vs_plain" in r]
    if not ratios:
        return None, "no vs_plain rows"
    med = statistics.median(ratios)
    return med <= 1.10, f"median {med:.2f}x of plain ({min(ratios):.2f}-{max(ratios):.2f}x)"


def _fp8_decode(out):
    rows = [r for r in _rows(out, "bench_attention") if r["impl"].endswith("[fp8]")]
    if not rows:
        return None, "no FP8 rows"
    big = max((r["batch"] * r["context"], r["batch"], r["context"]) for r in rows)
    at = [r for r in rows if (r["batch"], r["context"]) == big[1:]]
    value = ", ".join(f"{r['impl'].split(' ')[0]} {r['vs_bf16']:.2f}x" for r in at)
    return max(r["vs_bf16"] for r in at) < 1.0, f"batch {big[1]} x {big[2]}: {value}"


def _prefill(out):
    rows = [r for r in _rows(out, "bench_attention") if "vs_fa2" in r and "contiguous" in r["impl"]]
    if not rows:
        return None, "no Triton prefill rows beside aten FA2"
    big = max(rows, key=lambda r: (r["batch"] * r["context"], r["batch"]))
    return big["vs_fa2"] <= 1.5, (f"batch {big['batch']} x {big['context']}: "
                                  f"{big['vs_fa2']:.2f}x aten FA2's time")  # fmt: skip


def _soak(out):
    rows = _rows(out, "soak")
    if not rows:
        return None, "no soak JSON"
    bad = sum(r["violations"] + r["leaked_pages"] for r in rows)
    return bad == 0, f"{sum(r['ops'] for r in rows)} ops, {bad} violations or leaked pages"


def _hf(out):
    rows = [r for r in _rows(out, "hf") if r.get("cache") == "vmcache" and r["mode"] == "greedy"]
    if not rows:
        return None, "no greedy vmcache rows"
    worst = min(r["speed_vs_dynamic"] for r in rows)
    return worst >= 0.9, f"worst {worst:.2f}x DynamicCache tokens/s"


def _engine(out):
    rows = [r for r in _rows(out, "ab") if r.get("mode") == "compute" and "budget_requests" in r]
    pairs = {}
    for r in rows:
        pairs.setdefault(r["budget_requests"], {})[r["cache"]] = r["tok_per_s"]
    ratios = [p["vmcache"] / p["paged"] for p in pairs.values() if len(p) == 2]
    if not ratios:
        return None, "no compute rows"
    return min(ratios) >= 0.9, f"vmcache {min(ratios):.2f}-{max(ratios):.2f}x paged tokens/s"


# (id, the claim as docs/results.md states it, evaluator)
CLAIMS = [
    ("gpu_tests", "every GPU test passes, none skipped (CUDA VMM, aten FA2 and compiled Triton "
     "at page-boundary lengths, fp32, bf16, FP8 and INT8 K/V)", _tests),
    ("cuda_graph", "a CUDA graph captured once replays over pages mapped after the capture, "
     "equal to eager (the ranges never move)", _graph),
    ("syncs", "a decode step uploads at most one plan and the cache never synchronises",
     _syncs),
    ("attention_vs_plain", "decode on vmcache memory within 1.10x of the same kernel on an "
     "ordinary tensor (median over the grid)", _attention),
    ("fp8_decode", "FP8 K/V decode (Triton, half the bytes) faster than BF16's on both caches "
     "at the largest batch x context", _fp8_decode),
    ("prefill", "Triton prefill on vmcache within 1.5x of aten FA2's time (a 128-token chunk "
     "a sequence, the largest batch x context)", _prefill),
    ("soak", "CUDA soak: no violation, no leaked page", _soak),
    ("hf_speed", "VMCache greedy generate at >= 0.9x DynamicCache tokens/s", _hf),
    ("engine_vs_paged", "engine tokens/s with vmcache >= 0.9x paged at every budget", _engine),
]  # fmt: skip


def summarise(out: str) -> dict:
    claims = []
    for cid, text, fn in CLAIMS:
        try:
            ok, value = fn(out)
        except (OSError, KeyError, ValueError, ET.ParseError) as exc:
            ok, value = None, f"unreadable: {exc}"
        verdict = "not measured" if ok is None else "agrees" if ok else "DIFFERS"
        claims.append({"id": cid, "claim": text, "value": value, "verdict": verdict})
    steps = []
    if os.path.exists(os.path.join(out, "steps.jsonl")):
        steps = [
            json.loads(line) for line in open(os.path.join(out, "steps.jsonl")) if line.strip()
        ]
    preflight = {}
    if os.path.exists(os.path.join(out, "preflight.txt")):
        for line in open(os.path.join(out, "preflight.txt")):
            key, _, val = line.partition(":")
            preflight[key.strip()] = val.strip()
    stopped = None  # why the run ended before its steps (a failed preflight gate)
    if os.path.exists(os.path.join(out, "stopped.txt")):
        stopped = open(os.path.join(out, "stopped.txt")).read().strip() or None
    return {"gpu": preflight.get("gpu", "unknown"), "stopped": stopped,
            "preflight": preflight, "steps": steps, "claims": claims}  # fmt: skip


def compile_table(doc: dict) -> str:
    """benchmarks/results/compile_sm90.json as a table: per kernel and dtype, the worst case
    over the shapes (Llama-3-8B, Llama-3.2-1B, head_dim 96 MHA and GQA, Gemma-2-9B's head_dim
    256) and addressing modes."""
    lines = [f"Every Triton kernel compiled for sm_{doc['arch']} on the CPU (Triton "
             f"{doc['triton']}, the GPU image's; {doc['date']}) with the launch arguments "
             "the library produces; `ptxas -v`, worst case over "
             f"{len({r['shape'] for r in doc['rows']})} shapes × 3 addressing modes:",
             "", "| kernel | dtype | max registers | spill bytes (stores + loads) | "
             "max shared memory |", "|---|---|---|---|---|"]  # fmt: skip
    groups: dict = {}
    for r in doc["rows"]:
        groups.setdefault((r["kernel"], r["dtype"]), []).append(r)
    for (kernel, dtype), rs in sorted(groups.items()):
        spills = sum(r["spill_stores"] + r["spill_loads"] for r in rs)
        smem = max(r["shared_bytes"] for r in rs)
        lines.append(f"| `{kernel}` | {dtype} | {max(r['registers'] for r in rs)} | {spills} | "
                     f"{smem / 1024:.0f} KiB |")  # fmt: skip
    return "\n".join(lines) + "\n"


def readme_section(summary: dict | None) -> str:
    """docs/results.md's GPU claims, from a summary (or from none: every claim not measured)."""
    lines = ["| claim | measured | verdict |", "|---|---|---|"]
    if summary is None:
        head = ("**No GPU run yet**: no GPU figure is claimed. `scripts/gpu_check.sh` "
                "(one device call, 480 s deadline) checks each claim below and writes "
                "`summary.json`, the only input of this section.")  # fmt: skip
        for _, text, _ in CLAIMS:
            lines.append(f"| {text} | – | not measured |")
    else:
        head = (f"Measured on {summary['gpu']} ({summary.get('date', '')}) by "
                "`scripts/gpu_check.sh`; rendered from its `summary.json`.")  # fmt: skip
        for c in summary["claims"]:
            lines.append(f"| {c['claim']} | {c['value']} | {c['verdict']} |")
    return head + "\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--readme"]:
        path = argv[1] if len(argv) > 1 else None
        print(readme_section(json.load(open(path)) if path else None), end="")
        return 0
    if argv[:1] == ["--compile-table"]:
        print(compile_table(json.load(open(argv[1]))), end="")
        return 0
    out = argv[0]
    summary = summarise(out)
    import time

    summary["date"] = time.strftime("%Y-%m-%d")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for c in summary["claims"]:
        print(f"{c['verdict']:>12}  {c['id']:<20} {c['value']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
