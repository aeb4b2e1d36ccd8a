"""Compute mode's budgets fit any page size: the GPU setup (2 MiB pages, token_major), run
here over the host backend under the CUDA page rules, admits requests at every budget and
its radix rows really hit the prefix cache."""

import pytest
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


@pytest.mark.slow
def test_radix_rows_hit_whole_2_mib_pages():
    # two requests behind a system prompt of two 2 MiB pages: the second one's hit is the point
    rows = compute.run_prefix(CPU, 2, 4, setup=gpu_like())
    by = {(r["cache"], r["prefix_caching"]): r for r in rows}
    for cache in ("vmcache", "paged"):
        assert by[cache, False]["prefix_hit_tokens"] == 0
        assert by[cache, True]["prefix_hit_tokens"] > 0
        assert by[cache, True]["prefill_tokens"] < by[cache, False]["prefill_tokens"]


def test_quantized_kv_runs_both_caches_and_its_radix_rows_hit_whole_rows():
    """--kv-dtype int8-token: per-token scales make a row 80 bytes here (2 KV heads × 32 +
    16), which no 4 KiB page divides; the prefix rows' VM page grows to lcm(4096, 80)."""
    setup = compute.Setup(CPU)
    rows = compute.run(CPU, 4, [100.0], [2], repeats=1, setup=setup, kv="int8-token")
    assert {r["cache"] for r in rows} == {"vmcache", "paged"}
    assert all(r["kv_dtype"] == "int8-token" and r["tok_per_s"] > 0 for r in rows)
    _, spec = compute.model_and_spec(CPU, "int8-token")
    assert spec.bytes_per_token_per_layer == 80 and setup.page_for(spec, prefix=True) == 20480
    by = {
        (r["cache"], r["prefix_caching"]): r for r in compute.run_prefix(CPU, 3, 4, kv="int8-token")
    }
    assert (
        by["vmcache", True]["prefix_hit_tokens"] > 0 and by["paged", True]["prefix_hit_tokens"] > 0
    )
