"""Serving across processes on the CPU (gloo): the disaggregated engine (prefill on rank 0,
decode on rank 1) and tensor parallelism (TP = 2: transformers' tp_plan load, KV heads
sharded) give the single-process engine's greedy tokens (tests/serve_scenarios.py)."""

import pytest
import torch
from ranks import run_ranks
from serve_scenarios import CFG, DISAGG, disagg, model, tp

GREEDY = [f"r{i}" for i in range(8)] + ["forks"]


pytestmark = pytest.mark.slow  # end to end: scheduled first (tests/conftest.py)


@pytest.fixture(scope="module")
def disagg_results():
    return run_ranks(disagg, 2)


@pytest.mark.parametrize(
    "case",
    [(k, p) for k, *_ in DISAGG for p in ((False, True) if k == "paged" else (False,))],
    ids=str,
)
def test_disaggregated_outputs_equal_one_engine(disagg_results, case):
    prefill, decode = disagg_results[0][case], disagg_results[1][case]
    single = prefill["single"]
    assert prefill["outputs"] == decode["outputs"]  # both ranks end with every output
    for rid in GREEDY:
        assert prefill["outputs"][rid] == single[rid], rid
    # sampled with n = 2: the generator travels with the sequence, so these match too
    assert prefill["outputs"]["sampled"] == single["sampled"]
    assert prefill["left"] == decode["left"] == 0  # no page held once everything finished
    log = decode["log"]
    # one per request but r3 (1 token: it ends on rank 0); a sibling that found no slot to
    # fork into on rank 0 is prefilled and handed off on its own (up to 3 more)
    assert log["handoffs"] == prefill["log"]["handoffs"]
    assert 9 <= log["handoffs"] <= 12
    assert log["refused"] > 0  # the small decode pool refused hand-offs (retried later)
    assert decode["stats"]["generated_tokens"] > 0


def test_speculation_on_the_decode_worker_keeps_greedy_outputs(disagg_results):
    prefill, decode = disagg_results[0]["speculative"], disagg_results[1]["speculative"]
    single = disagg_results[0][("vm", False)]["single"]
    assert prefill["outputs"] == decode["outputs"]
    for rid in GREEDY:
        assert prefill["outputs"][rid] == single[rid], rid
    assert decode["stats"]["spec_proposed"] > 0 and decode["left"] == prefill["left"] == 0


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tiny-llama")
    model().save_pretrained(ckpt)
    return run_ranks(tp, 2, str(ckpt))


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_tensor_parallel_equals_one_process(tp_results, kind):
    r0, r1 = tp_results[0], tp_results[1]
    assert r0["spec"] == r1["spec"] == (CFG.num_key_value_heads // 2, CFG.num_attention_heads // 2)
    assert r0[kind]["outputs"] == r1[kind]["outputs"] == r0[kind]["single"]
    assert r0[kind]["tables"] == r1[kind]["tables"]  # same page tables at every step
    assert r0[kind]["preempted"] > 0  # the pools were small enough to preempt
    torch.testing.assert_close(r0[kind]["logits"], r0[kind]["single_logits"], atol=1e-5, rtol=1e-5)
    assert torch.equal(r0[kind]["logits"], r1[kind]["logits"])


def test_the_guides_tensor_parallel_check_runs_as_typed():
    """`python -m vmcache.distributed.launch --mode tp --nproc 2 --check`, as docs/guide.md
    shows it (no --model: a random Llama saved without tokenizer files, which the one-process
    reference must load as it is)."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "vmcache.distributed.launch", "--mode", "tp", "--nproc", "2",
           "--check"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["world"] == 2 and report["ranks"][0]["equal_to_one_process"] is True
