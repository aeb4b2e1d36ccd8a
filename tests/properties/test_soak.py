"""A short soak in CI (the full >= 100,000-operation run is benchmarks/soak.py)."""

import sys

import pytest
from repo import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import soak  # noqa: E402
import soak_prefix  # noqa: E402
from caches import record_coverage  # noqa: E402


@pytest.mark.parametrize("name", sorted(soak.factories("cpu")))
def test_soak_has_no_violation_and_no_leak(name):
    r = soak.soak(soak.factories("cpu")[name], ops=4000, seed=1, check_every=200)
    assert r["violations"] == 0, r["first_violations"]
    assert r["leaked_pages"] == 0
    # it did them all (operations completed, not just chosen), and the pool ran out
    done = r["done"]
    for op in ("new", "grow", "write", "fork", "free", "swap_out", "swap_in", "assign",
               "truncate", "reserve", "write_group"):  # fmt: skip
        assert done.get(op, 0) >= 20, (op, done)
    assert r["pool_full"] >= 20 and r["slots_full"] >= 1, r
    record_coverage(f"soak {name}", {**done, "pool full": r["pool_full"],
                                     "slots full": r["slots_full"]})  # fmt: skip


@pytest.mark.parametrize("name", ["VMKVCache layer_major", "VMKVCache token_major"])
def test_soak_under_the_cuda_page_rules_at_2_mib(name):
    """What --device cuda runs, on the host: 2 MiB pages, every CUDA page rule enforced."""
    make = soak.factories("cpu", strict=True)[name]
    assert make.spec.head_dim == 4096  # 64 tokens per 2 MiB page
    r = soak.soak(make, ops=300, seed=3, check_every=100)
    assert r["violations"] == 0, r["first_violations"]
    assert r["leaked_pages"] == 0 and r["done"].get("fork", 0) > 0


@pytest.mark.parametrize("name", sorted(soak_prefix.factories()))
def test_prefix_soak_hits_evicts_and_loses_nothing(name):
    """Prefix operations in a soak: K/V a function of (token, position), so a wrong reuse
    shows; lookups hit, the pool runs out, every operation completes many times."""
    r = soak_prefix.soak(soak_prefix.factories()[name], ops=2500, seed=4)
    assert r["violations"] == 0, r["first_violations"]
    assert r["leaked_pages"] == 0
    assert r["hits"] >= r["lookups"] // 4 and r["pool_full"] > 0, r
    for op in ("new", "append", "fork", "assign", "truncate", "free", "cache_prefix",
               "swap_out", "swap_in", "evict"):  # fmt: skip
        assert r["done"].get(op, 0) >= 10, (op, r["done"])
    record_coverage(f"prefix soak {name}", {"hits": r["hits"], "lookups": r["lookups"],
                                            "pool full": r["pool_full"], **r["done"]})  # fmt: skip
