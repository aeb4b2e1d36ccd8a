"""benchmarks/bench_multi.py's workload, kvcached's staggered peaks: per model P^2 requests in
its peak (1, 2, .., P, .., 1 a second), 1 a second outside it, the peaks never overlapping
(the full run against the static split is `make bench-multi`)."""

import collections
import sys

import pytest
from repo import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_multi  # noqa: E402


@pytest.mark.parametrize("peak", [1, 2, 4, 7])
def test_each_model_sends_p_squared_in_its_peak_and_one_a_second_outside(peak):
    plan = bench_multi.arrivals(peak, 3)
    width = 2 * peak - 1
    assert plan == sorted(plan) and {k for _, k in plan} == {0, 1, 2}
    for k in range(3):
        inside = [t for t, m in plan if m == k and k * width <= t < (k + 1) * width]
        outside = [t for t, m in plan if m == k and not k * width <= t < (k + 1) * width]
        assert len(inside) == peak * peak
        per_second = collections.Counter(int(t - k * width) for t in inside)
        assert [per_second[s] for s in range(width)] == [
            min(s + 1, width - s) for s in range(width)
        ]
        assert len(outside) == 2 * width and all(t % 1 == 0.5 for t in outside)
    for s in range(3 * width):  # in every second, at most one model above 1 request
        busy = collections.Counter(m for t, m in plan if int(t) == s)
        assert sum(1 for n in busy.values() if n > 1) <= 1


def test_the_kv_arithmetic_says_what_a_third_and_the_budget_hold():
    class A:
        prompt, output, max_seq_len, budget_mib = 8, 8, 64, 26.25

    kv = bench_multi.kv_arithmetic(A)
    assert kv["sequence_bytes"] == 60 * 65536  # a page per layer and K/V below 85 tokens
    assert (kv["sequences_in_a_third"], kv["sequences_in_the_budget"]) == (2, 7)
    assert kv["floor_bytes"] == 60 * 65536
