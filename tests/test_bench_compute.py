"""Compute mode's budgets fit any page size: the GPU setup (2 MiB pages, token_major), run
here over the host backend under the CUDA page rules, admits requests at every budget and
its radix rows really hit the prefix cache."""

import torch

from vmcache.bench import compute
from vmcache.memory.backends.host import HostBackend
from vmcache.memory.backends.strict import CUDA_GRANULARITY, StrictBackend

CPU = torch.device("cpu")


def gpu_like():
    return compute.Setup(CPU, backend_factory=lambda: StrictBackend(HostBackend()))


def test_the_gpu_setup_uses_2_mib_token_major_pages():
    setup = gpu_like()
    assert setup.page_size == CUDA_GRANULARITY and setup.layout == "token_major"
    assert compute.Setup(CPU).page_size == 4096


def test_every_budget_runs_both_caches_at_2_mib_pages():
    rows = compute.run(CPU, 6, [100.0], [1, 4], repeats=1, setup=gpu_like())
    assert {(r["cache"], r["budget_requests"]) for r in rows} == {
        (c, n) for c in ("vmcache", "paged") for n in (1, 4)
    }
    for r in rows:
        assert r["steps"] > 0 and r["tok_per_s"] > 0 and r["page_bytes"] == CUDA_GRANULARITY
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["tpot_p50_s"] > 0
    one = [r for r in rows if r["budget_requests"] == 1 and r["cache"] == "vmcache"][0]
    four = [r for r in rows if r["budget_requests"] == 4 and r["cache"] == "vmcache"][0]
    assert one["max_running"] >= 1 and four["max_running"] > one["max_running"]


def test_radix_rows_hit_whole_2_mib_pages():
    rows = compute.run_prefix(CPU, 3, 4, setup=gpu_like())
    by = {(r["cache"], r["prefix_caching"]): r for r in rows}
    for cache in ("vmcache", "paged"):
        assert by[cache, False]["prefix_hit_tokens"] == 0
        assert by[cache, True]["prefix_hit_tokens"] > 0
        assert by[cache, True]["prefill_tokens"] < by[cache, False]["prefill_tokens"]
