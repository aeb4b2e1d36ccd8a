"""Helpers of scripts/render_readme.py: the newest results file, its source line, number
formatting and Markdown tables."""

from __future__ import annotations

import glob
import json
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def newest(pattern: str) -> tuple[str, dict]:
    """The newest results file matching ``pattern`` (dates sort in names)."""
    paths = sorted(glob.glob(os.path.join(RESULTS, pattern)))
    if not paths:
        raise FileNotFoundError(f"no benchmarks/results/{pattern}")
    return os.path.basename(paths[-1]), json.load(open(paths[-1]))


def source(name: str, doc: dict) -> str:
    sha = (doc.get("git_sha") or "?")[:10] + (" (uncommitted changes)" if doc.get("git_dirty")
                                              else "")  # fmt: skip
    return (
        f"*Source: `benchmarks/results/{name}`, {doc['date']}, {doc['device']} "
        f"({doc.get('cpu', '?')}), commit {sha}.*\n"
    )


def f(x, digits: int = 3) -> str:
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != x:
            return "–"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    return str(x)


def md(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
