"""A short soak in CI (the full >= 100,000-operation run is benchmarks/soak.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import soak  # noqa: E402


@pytest.mark.parametrize("name", sorted(soak.factories("cpu")))
def test_soak_has_no_violation_and_no_leak(name):
    r = soak.soak(soak.factories("cpu")[name], ops=4000, seed=1, check_every=200)
    assert r["violations"] == 0, r["first_violations"]
    assert r["leaked_pages"] == 0
    assert r["cachefull"] > 0 and r["fork"] > 0 and r.get("swap_in", 0) > 0  # it hit them all


@pytest.mark.parametrize("name", ["VMKVCache layer_major", "VMKVCache token_major"])
def test_soak_under_the_cuda_page_rules_at_2_mib(name):
    """What --device cuda runs, on the host: 2 MiB pages, every CUDA page rule enforced."""
    make = soak.factories("cpu", strict=True)[name]
    assert make.spec.head_dim == 4096  # 64 tokens per 2 MiB page
    r = soak.soak(make, ops=300, seed=3, check_every=100)
    assert r["violations"] == 0, r["first_violations"]
    assert r["leaked_pages"] == 0 and r["fork"] > 0
