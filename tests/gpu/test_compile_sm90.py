"""The Triton kernels compile for sm_90 (H200) on this CPU-only machine, with the launch
arguments the library itself produces, and none spills registers (head_dim up to 256).

The quick subset compiles here in a subprocess (``@triton.jit`` reads ``TRITON_INTERPRET`` at
import, and the suite interprets); ``make compile-sm90`` compiles the whole grid into
``benchmarks/results/compile_sm90.json``, which the last test checks."""

import itertools
import json
import os
import subprocess
import sys

import pytest
from repo import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "compile_sm90.py")
COMMITTED = os.path.join(ROOT, "benchmarks", "results", "compile_sm90.json")

pytest.importorskip("triton.backends.nvidia")


def _check_rows(rows):
    assert rows, "nothing compiled"
    for r in rows:
        assert r["registers"] <= 255, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r  # head_dim 256 included
        assert r["shared_bytes"] <= 227 * 1024, r  # H100/H200 per-block limit


def test_quick_subset_compiles_for_sm90_without_spills(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    doc = json.loads((tmp_path / "compile_sm90.json").read_text())
    assert doc["arch"] == 90
    rows = doc["rows"]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"_decode_partial", "_combine", "_prefill", "_prefill (tree)"}
    assert {r["mode"] for r in rows} == {"paged", "layer_major", "token_major"}
    assert {"bf16/fp8e4m3", "bf16/int8", "bf16/int8-token"} <= {r["dtype"] for r in rows}
    _check_rows(rows)


def test_interpreted_runs_refuse_to_compile():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, SCRIPT, "--quick"], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode != 0 and "TRITON_INTERPRET" in res.stderr


def test_committed_grid_covers_every_shape_dtype_and_mode():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    doc = json.load(open(COMMITTED))
    rows = doc["rows"]
    shapes = ("llama-3-8b", "llama-3.2-1b", "d96-mha", "d96-gqa", "gemma-2-9b")
    dtypes = (
        "bf16",
        "fp16",
        "fp32",
        "bf16/fp8e4m3",
        "bf16/fp8e5m2",
        "bf16/int8",
        "bf16/int8-token",
        "bf16/fp8e4m3-token",
    )
    want = set(itertools.product(shapes, dtypes, ("paged", "layer_major", "token_major")))
    got = {(r["shape"], r["dtype"], r["mode"]) for r in rows}
    assert got == want
    assert doc["arch"] == 90 and doc["triton"].startswith("3.")
    _check_rows(rows)


def test_a_growing_decode_compiles_each_kernel_once():
    """Lengths 1 → 4,999 (1 to 5 split-K partitions), batch 1 ↔ 2, block tables 1 → 313
    wide, prefills of 1 to 5 queries: every kernel is compiled at most once per addressing
    mode (1–5 s each on a GPU)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run([sys.executable, SCRIPT, "--growth"], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(counts) == {"paged", "layer_major", "token_major"}
    assert counts["paged"] == {"_decode_partial": 1, "_combine": 1, "_prefill": 1}
    for mode, per_kernel in counts.items():
        assert all(n <= 1 for n in per_kernel.values()), (mode, per_kernel)
