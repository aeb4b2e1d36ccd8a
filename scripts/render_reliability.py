"""Render docs/results.md's coverage table from benchmarks/results/coverage.json (``make
coverage``): what the fixed-seed randomized tests actually reached. tests/gpu/test_gpu_check.py
fails when docs/results.md and the JSON disagree.

    python scripts/render_reliability.py [benchmarks/results/coverage.json]
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT = os.path.join(ROOT, "benchmarks", "results", "coverage.json")


def coverage_table(doc: dict) -> str:
    lines = ["| randomized test (fixed seed) | pool full | slot table full | copy-on-write "
             "splits | swap-ins done | prefix hits / lookups |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, c in sorted(doc.items()):
        if name == "fault injection":
            continue
        hits = f"{c['hits']} / {c['lookups']}" if "lookups" in c else "–"
        lines.append(f"| {name} | {c.get('pool full', '–')} | {c.get('slots full', '–')} | "
                     f"{c.get('cow split', '–')} | {c.get('swap_in', '–')} | {hits} |")  # fmt: skip
    faults = doc.get("fault injection", {})
    if faults:
        lines += ["", "| operation under fault injection | fallible calls, each failed once |",
                  "|---|---|"]  # fmt: skip
        for op, n in sorted(faults.items()):
            lines.append(f"| {op.removesuffix(': failure points')} | {n} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(coverage_table(json.load(open(sys.argv[1] if len(sys.argv) > 1 else DEFAULT))), end="")
