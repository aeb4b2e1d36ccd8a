"""Speculative decoding in the engine (prompt lookup): greedy outputs equal the engine's
without speculation (and generate's) on every cache, through preemption by swap and by
recompute, with n > 1 and with prefix caching; drafts are accepted where the text repeats;
rejected drafts are truncated away (pages back in the pool); and the verifier keeps the target
distribution when sampling (a statistical test that a verifier accepting every draft fails)."""

import pytest
import torch
from caches import strict_host
from draft_cases import draft_cache, draft_llama, repeating, run
from engine_cases import LONG, MIXED, make, prefix_vm, reference, requests

from vmcache import KVSpec, VMKVCache
from vmcache.engine import DraftModel, Engine, NgramDrafter, Request, SamplingParams
from vmcache.engine.drafts import target_probs, verify
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants


@pytest.mark.parametrize("kind,pages", [("vm", 64), ("paged", 48), ("vm", 12), ("paged", 8)])
@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_greedy_outputs_equal_without_speculation(model, kind, pages, policy):
    reqs = requests(LONG, seed=1) + repeating()
    plain, _ = run(model, make(kind, pages), reqs, preemption=policy)
    spec, st = run(model, make(kind, pages), reqs, preemption=policy,
                   speculative=NgramDrafter(k=4))  # fmt: skip
    assert spec == plain
    want = reference(model, reqs)
    assert spec == {rid: [toks] for rid, toks in want.items()}
    assert st.speculation.proposed > 0 and st.speculation.accepted > 0
    if pages < 20:
        assert st.preempt_swap + st.preempt_recompute > 0  # speculation under pressure too


def test_accepted_drafts_take_fewer_target_steps_and_rollback_returns_pages(model):
    reqs = repeating(n=1, new=60)
    _, plain = run(model, make("vm", 64), reqs)
    _, st = run(model, make("vm", 64), reqs, speculative=NgramDrafter(k=4))
    assert st.generated_tokens == plain.generated_tokens == 60
    assert st.steps < plain.steps  # several tokens per target step
    assert st.speculation.accepted / st.speculation.proposed > 0.3
    assert (
        st.speculation.rolled_back == st.speculation.proposed - st.speculation.accepted
    )  # every reject undone


def test_adaptive_k_proposes_less_where_drafts_fail_and_changes_no_output(model):
    reqs = requests(MIXED, seed=3)  # random prompts: few drafts match
    fixed, st_fixed = run(
        model, make("vm", 64), reqs, speculative=NgramDrafter(k=6, adaptive=False)
    )
    adaptive, st = run(model, make("vm", 64), reqs, speculative=NgramDrafter(k=6))
    assert fixed == adaptive
    assert (
        st.speculation.proposed - st.speculation.accepted
        < st_fixed.speculation.proposed - st_fixed.speculation.accepted
    )
    d = NgramDrafter(k=4)
    assert [d.next_k(None, None), d.next_k(4, 0), d.next_k(1, 1), d.next_k(4, 4)] == [4, 1, 2, 4]


def test_n_greater_than_one_and_mixed_batches(model):
    reqs = [Request("n3", tuple(range(5, 13)) * 2, SamplingParams(max_new_tokens=20, n=3))]
    reqs += requests(MIXED)
    plain, _ = run(model, make("vm", 64), reqs)
    spec, st = run(model, make("vm", 64), reqs, speculative=NgramDrafter(k=3))
    assert spec == plain and st.speculation.proposed > 0


def test_prefix_caching_indexes_only_accepted_tokens(model):
    reqs = repeating(n=3, new=30)
    plain, _ = run(model, prefix_vm(64), reqs)
    spec, st = run(model, prefix_vm(64), reqs, speculative=NgramDrafter(k=4))
    assert spec == plain and st.speculation.rolled_back > 0


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_a_sliding_window_model_rolls_back_within_its_margin(kind):
    """Mistral with an 8-token window: a rejected draft is truncated within the rollback
    margin (never into a released page); without the margin the engine refuses."""
    from sliding_cases import make as make_sliding
    from sliding_cases import pair

    m, _ = pair("mistral")
    spec = KVSpec.from_hf_config(m.config)
    with pytest.raises(ValueError, match="rollback_tokens"):
        Engine(m, make_sliding(kind, spec, 64), speculative=NgramDrafter(k=4))
    reqs = repeating(n=3, new=30)
    reqs = [Request(r.req_id, tuple(t % m.config.vocab_size for t in r.prompt), r.params)
            for r in reqs]  # fmt: skip
    plain, _ = run(m, make_sliding(kind, spec, 64), reqs)
    if kind == "vm":
        cache = VMKVCache(spec, 8, 96, page_size=4096, backend=strict_host(), own_backend=True,
                          pool_bytes=64 * 4096, rollback_tokens=4)  # fmt: skip
    else:
        cache = PagedKVCache(spec, num_blocks=64, block_size=8, max_seq_len=96, max_seqs=8,
                             rollback_tokens=4)  # fmt: skip
    spec_out, st = run(m, cache, reqs, speculative=NgramDrafter(k=4))
    assert spec_out == plain and st.speculation.rolled_back > 0
    assert cache.stats().window_released_pages > 0


def test_bad_speculative_arguments(model):
    with pytest.raises(TypeError):
        Engine(model, make("vm", 8), speculative=4)
    for bad in ({"k": 0}, {"max_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}):
        with pytest.raises(ValueError):
            NgramDrafter(**bad)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    d = NgramDrafter(k=3, max_ngram=2)
    assert d.propose([1, 2, 3, 4, 9, 1, 2], 10) == [3, 4, 9]
    assert d.propose([1, 2, 3, 1, 2, 7, 1, 2], 10) == [7, 1, 2]  # the latest occurrence
    assert d.propose([5, 6, 7], 10) == [] and d.propose([1, 2, 1], 0) == []
    assert d.propose([1, 2, 3, 4, 9, 1, 2], 1) == [3]


def _first_token_counts(verifier, trials=20000, seed=0):
    """How often each token comes out first when a fixed draft is verified against a fixed
    target distribution over 6 tokens."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -0.5], [0.0] * 6])
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(6)
    for _ in range(trials):
        accepted, token = verifier(logits, [3], 1.0, 0, g)
        counts[3 if accepted else token] += 1
    return counts, target_probs(logits[0], 1.0, 0)


def _chi2(counts, p):
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_tokens_follow_the_target_distribution():
    counts, p = _first_token_counts(verify)
    assert _chi2(counts, p) < 20.5  # chi-square, 5 degrees of freedom: p ≈ 0.001

    def accepts_every_draft(rows, drafts, temperature, top_k, g):
        return len(drafts), 0

    counts, p = _first_token_counts(accepts_every_draft, trials=2000)
    assert _chi2(counts, p) > 1000  # the test can fail


@pytest.mark.parametrize("kind,pages", [("vm", 64), ("paged", 48), ("vm", 12)])
@pytest.mark.parametrize("draft", ["small", "target"])
def test_a_draft_model_on_its_own_cache_keeps_greedy_outputs(model, kind, pages, draft):
    """A one-layer random draft (often wrong: rollbacks) and the target itself as its own
    draft (the upper bound: every draft accepted); preemption on the small pool."""
    reqs = requests(LONG, seed=1) + repeating(n=2)
    plain, _ = run(model, make(kind, pages), reqs)
    dm = draft_llama() if draft == "small" else model
    drafter = DraftModel(dm, draft_cache(dm), k=4)
    spec_out, st = run(model, make(kind, pages), reqs, speculative=drafter)
    assert spec_out == plain
    assert st.speculation.proposed > 0
    if draft == "target":
        assert st.speculation.accepted == st.speculation.proposed  # the target agrees with itself
    else:
        assert st.speculation.rolled_back > 0
    assert not drafter.kv.sequences  # every draft slot freed
    check_invariants(drafter.kv)


def test_a_draft_model_needs_the_vocabulary_and_its_own_cache(model):
    cache = make("vm", 64)
    with pytest.raises(ValueError, match="its own cache"):
        Engine(model, cache, speculative=DraftModel(model, cache))
    with pytest.raises(ValueError):
        DraftModel(model, draft_cache(model), k=0)
