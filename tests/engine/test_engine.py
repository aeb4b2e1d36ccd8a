"""The engine: greedy outputs equal per-request generate(), with and without preemption, for
both policies and both caches; nothing is lost on a tiny budget; forks share the prompt."""

import pytest
import torch
from caches import strict_host
from engine_cases import LONG, MIXED, SPEC, make, prefix_vm, reference, requests

from vmcache import VMKVCache
from vmcache.engine import Engine, Request, SamplingParams
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants


@pytest.mark.parametrize("kind,pages", [("vm", 24), ("vm", 12), ("paged", 12), ("paged", 6)])
@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_greedy_equals_generate_under_preemption(model, kind, pages, policy):
    reqs = requests(LONG, seed=1)
    engine = Engine(model, make(kind, pages), preemption=policy)
    out = engine.run(reqs)
    assert out == {rid: [toks] for rid, toks in reference(model, reqs).items()}
    st = engine.stats
    assert (st.preempt_swap if policy == "swap" else st.preempt_recompute) > 0
    assert st.preempt_swap * (policy == "recompute") == 0
    assert (st.swap_bytes > 0) == (policy == "swap")
    check_invariants(engine.kv)
    assert engine.kv.stats().physical_pages == 0 and not engine.kv.sequences


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_mixed_batch_without_pressure_equals_generate(model, kind):
    reqs = requests(MIXED)
    engine = Engine(model, make(kind, 400))
    out = engine.run(reqs)
    assert out == {rid: [toks] for rid, toks in reference(model, reqs).items()}
    assert engine.stats.preempt_recompute == engine.stats.preempt_swap == 0
    assert engine.stats.max_running == 5  # all admitted together, prefills packed in one step


@pytest.mark.parametrize("victim", ["last", "first"])
def test_tiny_budget_loses_nothing(model, victim):
    reqs = requests([(30, 40)] * 6, seed=2)
    engine = Engine(model, make("vm", 12), preemption="swap", victim=victim)
    out = engine.run(reqs)
    assert sorted(out) == [r.req_id for r in reqs]
    assert all(len(o[0]) == 40 for o in out.values())
    assert out == {rid: [toks] for rid, toks in reference(model, reqs).items()}


def test_parallel_sampling_forks_share_the_prompt(model):
    prompt = tuple(range(1, 100))
    params = SamplingParams(max_new_tokens=3, n=4, temperature=1.0, seed=5)
    engine = Engine(model, make("vm", 200))
    engine.add_request(Request("p", prompt, params))
    engine.step()  # prefill once, fork three, sample four first tokens
    st = engine.kv.stats()
    assert st.num_sequences == 4 and st.shared_pages >= 4 * 3  # 3 full prompt pages per table
    assert engine.stats.prefill_tokens == len(prompt)
    out = engine.run()["p"]
    assert len(out) == 4 and all(len(o) == 3 for o in out)
    again = Engine(model, make("paged", 200)).run([Request("p", prompt, params)])["p"]
    assert again == out  # seeded per sequence: same samples on the other cache
    # greedy n = 4: every fork continues from the prompt alone, like n = 1
    greedy = SamplingParams(max_new_tokens=6, n=4)
    four = Engine(model, make("vm", 200)).run([Request("g", prompt, greedy)])["g"]
    (one,) = Engine(model, make("vm", 200)).run([Request("g", prompt, SamplingParams(6))])["g"]
    assert four == [one] * 4


def test_stop_token_ends_a_sequence(model):
    (req,) = requests([(12, 30)])
    first = Engine(model, make("vm", 100)).run([req])["r0"][0]
    stop = first[4]
    params = SamplingParams(max_new_tokens=30, stop_token_ids=[stop])
    engine = Engine(model, make("vm", 100))
    out = engine.run([Request("s", req.prompt, params)])["s"][0]
    assert out == first[: first.index(stop) + 1]
    assert engine.finish_reasons == {"s": ["stop"]}


def test_bad_requests_raise_before_anything_changes(model):
    engine = Engine(model, make("vm", 12))
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request(Request("a", (1,) * 100, SamplingParams(max_new_tokens=40)))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request(Request("b", (), SamplingParams()))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request(Request("c", (1, 999), SamplingParams()))
    with pytest.raises(TypeError):
        engine.add_request(("d", (1, 2)))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="preemption"):
        Engine(model, make("vm", 12), preemption="drop")
    engine.add_request(Request("ok", (1, 2), SamplingParams(max_new_tokens=2)))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(Request("ok", (1, 2), SamplingParams()))
    assert engine.run() == {"ok": [engine.outputs["ok"][0]]} and not engine.kv.sequences


def system_prompt_requests(seed: int, own: int, new: int) -> list[Request]:
    """Four requests: one 70-token system prompt, then ``own + i`` tokens of their own."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 128, (70,), generator=g).tolist()
    return [Request(f"s{i}", tuple(system + torch.randint(0, 128, (own + i,), generator=g)
                                   .tolist()), SamplingParams(max_new_tokens=new))
            for i in range(4)]  # fmt: skip


def prefix_cache(kind: str):
    if kind == "vm":
        return prefix_vm(200)
    return PagedKVCache(SPEC, num_blocks=200, block_size=16, max_seq_len=128, max_seqs=8,
                        prefix_caching=True)  # fmt: skip


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_prefix_caching_changes_no_output_and_skips_shared_prefill(model, kind):
    reqs = system_prompt_requests(seed=4, own=5, new=8)
    want = {rid: [toks] for rid, toks in reference(model, reqs).items()}
    plain = Engine(model, make(kind, 200))
    assert plain.run(reqs) == want
    kv = prefix_cache(kind)
    cached = Engine(model, kv)
    cached.add_request(reqs[0])
    cached.step()  # the first request's prefill indexes the system prompt's full pages
    assert cached.run(reqs[1:]) == want
    full = 70 // kv.prefix.tokens_per_entry * kv.prefix.tokens_per_entry
    assert cached.stats.prefix_hit_tokens == 3 * full
    assert cached.stats.prefill_tokens == plain.stats.prefill_tokens - 3 * full
    check_invariants(kv)


def test_a_fully_cached_prompt_recomputes_only_its_last_token(model):
    """The whole prompt is cached: the engine keeps its last token to compute, so the tail
    page, shared with the index, is copied on write; the output does not change."""
    prompt = tuple(range(1, 65))  # exactly two full 32-token pages per (layer, K/V) row
    (want,) = reference(model, [Request("x", prompt, SamplingParams(max_new_tokens=6))]).values()
    kv = prefix_vm(100)
    engine = Engine(model, kv)
    assert engine.run([Request("a", prompt, SamplingParams(max_new_tokens=6))])["a"] == [want]
    copies = kv.stats().cow_copies
    assert engine.run([Request("b", prompt, SamplingParams(max_new_tokens=6))])["b"] == [want]
    assert engine.stats.prefix_hit_tokens == 63
    assert kv.stats().cow_copies > copies  # the shared tail page was split, not overwritten
    check_invariants(kv)


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_map_ahead_changes_no_output(model, kind):
    reqs = requests(LONG, seed=3)
    ahead = Engine(model, make(kind, 24 if kind == "vm" else 12), preemption="swap")
    plain = Engine(model, make(kind, 24 if kind == "vm" else 12), preemption="swap",
                   map_ahead=False)  # fmt: skip
    assert ahead.run(reqs) == plain.run(reqs)
    assert ahead.stats.premapped_pages > 0 and plain.stats.premapped_pages == 0
    check_invariants(ahead.kv)
    assert ahead.kv.stats().physical_pages == 0


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_a_step_that_writes_no_kv_fails_loudly(model, kind):
    """transformers 5.17-5.23 take past_key_values=, 5.24+ cache=; a decoder layer given the
    other name swallows it and writes nothing. The engine must refuse, not return logits."""
    from vmcache.hf import cache_keyword

    engine = Engine(model, make(kind, 64))
    assert engine.runner.cache_arg == cache_keyword(model.model.layers[0])
    engine.runner.cache_arg = "not_the_cache_keyword"
    with pytest.raises(RuntimeError, match="wrote no K/V"):
        engine.run([Request("a", (1, 2, 3), SamplingParams(max_new_tokens=2))])


@pytest.mark.parametrize("victim", ["last", "first"])
def test_the_victim_is_the_last_or_the_first_admitted(model, victim):
    # a 5-token prompt per step (max_batch_tokens 8 holds it and <= 3 decodes): admitted at
    # different steps, they outgrow the 20-page pool together
    reqs = requests([(5, 60)] * 6, seed=2)
    engine = Engine(model, make("vm", 20), preemption="swap", victim=victim,
                    max_batch_tokens=8)  # fmt: skip
    picks = []
    real = engine.scheduler._pick_victim

    def pick(exclude):  # the scheduler's own choice, recorded with its alternatives
        chosen = real(exclude)
        others = [s.admitted_at for s in engine.scheduler.running if s is not exclude]
        picks.append((chosen.admitted_at if chosen else None, others))
        return chosen

    engine.scheduler._pick_victim = pick
    assert engine.run(reqs) == {rid: [t] for rid, t in reference(model, reqs).items()}
    assert any(len(others) > 1 and len(set(others)) > 1 for _, others in picks)
    for chosen, others in picks:
        assert chosen == (max(others) if victim == "last" else min(others))


def test_a_full_swap_tier_falls_back_to_recompute(model):
    kv = VMKVCache(SPEC, 8, 128, page_size=4096, backend=strict_host(), own_backend=True,
                   pool_bytes=12 * 4096, swap_bytes=1)  # fmt: skip
    reqs = requests(LONG, seed=1)
    engine = Engine(model, kv, preemption="swap")
    assert engine.run(reqs) == {rid: [t] for rid, t in reference(model, reqs).items()}
    assert engine.stats.preempt_swap == 0 and engine.stats.preempt_recompute > 0


def test_max_batch_tokens_bounds_every_step(model):
    reqs = requests(MIXED)
    engine = Engine(model, make("vm", 400), max_batch_tokens=40)
    sizes = []
    real = engine.runner.step

    def step(slots, starts, tokens):
        sizes.append(sum(len(t) for t in tokens))
        return real(slots, starts, tokens)

    engine.runner.step = step
    assert engine.run(reqs) == {rid: [t] for rid, t in reference(model, reqs).items()}
    # every step within the budget: the 50-token prompt is prefilled in chunks
    assert max(sizes) == 40 and all(n <= 40 for n in sizes), sizes
    assert engine.stats.prefill_tokens == sum(len(r.prompt) for r in reqs)


@pytest.mark.parametrize("kind", ["vm", "paged"])
@pytest.mark.parametrize("budget", [1, 7, 16])
def test_chunked_prefill_changes_no_output(model, kind, budget):
    """Prompts several times the step budget: fed in chunks (K/V written chunk by chunk,
    positions continuing), decodes first; greedy outputs equal per-request generate()."""
    reqs = requests([(45, 6), (3, 9), (31, 5), (60, 4)], seed=5)
    engine = Engine(model, make(kind, 400), max_batch_tokens=budget)
    fed = []
    real = engine.runner.step

    def step(slots, starts, tokens):
        fed.append([len(t) for t in tokens])
        return real(slots, starts, tokens)

    engine.runner.step = step
    assert engine.run(reqs) == {rid: [t] for rid, t in reference(model, reqs).items()}
    assert all(sum(f) <= budget for f in fed), fed
    assert len(fed) >= -(-60 // budget)  # the longest prompt alone needs that many steps
    check_invariants(engine.kv)


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_requests_sharing_a_prefix_in_one_step_share_it(model, kind):
    """Four requests with one system prompt arrive together: one prefills it, the others
    wait for it (``prefix_waits``) and then map it; outputs unchanged."""
    reqs = system_prompt_requests(seed=6, own=4, new=5)
    want = {rid: [toks] for rid, toks in reference(model, reqs).items()}
    kv = prefix_cache(kind)
    engine = Engine(model, kv)
    assert engine.run(reqs) == want
    full = 70 // kv.prefix.tokens_per_entry * kv.prefix.tokens_per_entry
    assert engine.stats.prefix_waits >= 3 and engine.stats.prefix_hit_tokens == 3 * full
    assert engine.stats.prefill_tokens == sum(len(r.prompt) for r in reqs) - 3 * full
    check_invariants(kv)


def test_slot_limited_admission_and_forks_without_free_slots(model):
    """3 slots: requests wait for slots; an n = 4 request can fork only as slots free up,
    and still returns 4 outputs."""
    kv = VMKVCache(SPEC, 3, 128, page_size=4096, backend=strict_host(), own_backend=True,
                   pool_bytes=200 * 4096)  # fmt: skip
    engine = Engine(model, kv)
    reqs = requests([(10, 5)] * 4, seed=3)
    out = engine.run(reqs)
    assert out == {rid: [t] for rid, t in reference(model, reqs).items()}
    assert engine.stats.max_running <= 3
    greedy4 = Engine(model, VMKVCache(SPEC, 3, 128, page_size=4096, backend=strict_host(),
                                      own_backend=True, pool_bytes=200 * 4096))  # fmt: skip
    many = greedy4.run([Request("n4", reqs[0].prompt, SamplingParams(max_new_tokens=5, n=4))])
    assert many["n4"] == [out["r0"][0]] * 4


def test_a_request_that_can_never_fit_is_refused_before_it_runs(model):
    engine = Engine(model, make("vm", 4))  # 4 pages: one 32-token page per (layer, K/V)
    with pytest.raises(ValueError, match="the pool has 4"):  # refused, not left to hang
        engine.add_request(Request("big", tuple(range(1, 60)), SamplingParams(max_new_tokens=60)))
    assert not engine.scheduler.has_work()
    # one that fits alone runs; n = 2 forks cannot both grow here: CacheFull, not a hang
    ok = Request("fits", tuple(range(1, 20)), SamplingParams(max_new_tokens=10))
    assert len(engine.run([ok])["fits"][0]) == 10


def test_sampling_samples_differ_and_top_k_restricts_them(model):
    prompt = tuple(range(1, 20))
    params = SamplingParams(max_new_tokens=6, n=4, temperature=1.5, seed=11)
    out = Engine(model, make("vm", 200)).run([Request("p", prompt, params)])["p"]
    assert len({tuple(o) for o in out}) > 1  # four samples, not four copies
    top1 = SamplingParams(max_new_tokens=6, n=2, temperature=1.5, top_k=1, seed=11)
    (greedy,) = reference(model, [Request("g", prompt, SamplingParams(max_new_tokens=6))]).values()
    got = Engine(model, make("vm", 200)).run([Request("p", prompt, top1)])["p"]
    assert got == [greedy, greedy]  # top_k = 1 is greedy whatever the temperature


def test_request_salts_keep_tenants_apart(model):
    kv = prefix_vm(200)
    engine = Engine(model, kv)
    prompt = tuple(range(1, 70))
    p = SamplingParams(max_new_tokens=3)
    first = engine.run([Request("a", prompt, p, salt="tenant-a")])
    assert engine.stats.prefix_hit_tokens == 0
    other = engine.run([Request("b", prompt, p, salt="tenant-b")])
    assert engine.stats.prefix_hit_tokens == 0  # another tenant's pages are never matched
    same = engine.run([Request("c", prompt, p, salt="tenant-a")])
    assert engine.stats.prefix_hit_tokens > 0
    assert first["a"] == other["b"] == same["c"]


def test_the_batched_greedy_pick_is_argmax_on_ties_nan_and_infinities():
    """The engine picks every greedy row's token with max(-1).indices (a third of argmax's
    time on [16, 49152]); on every torch it supports that must be argmax's choice: the first
    maximum, a NaN winning, +inf over finite."""
    rows = torch.randn(8, 300)
    rows[1, [3, 200]] = rows[1].max() + 1  # a tie: the first
    rows[2, [7, 9]] = float("nan")
    rows[3] = float("-inf")
    rows[4, 250] = float("inf")
    rows[5] = 0.0
    assert rows.max(-1).indices.tolist() == rows.argmax(-1).tolist()
    assert rows.max(-1).indices[[1, 2, 3, 4, 5]].tolist() == [3, 7, 0, 250, 0]
