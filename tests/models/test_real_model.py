"""The real-model tier: the trained SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads,
head_dim 64: 768-byte fp32 K/V rows, which divide no page) on chat prompts built with its own
template. Greedy drop-in parity (both caches, left-padded batches, beams, attn "vmcache"),
engine parity up to and including where the model stops (its EOS), prefix-cache hits across a
multi-turn chat on a long system prompt, speculation (prompt lookup as a chain and as a tree,
a draft model), swap / recompute preemption leaving greedy outputs unchanged, and the server's
chat answers (the server's own tests run a random 2-layer model)."""

import pytest
import torch
from real_model import QUESTIONS, SYSTEM, generate, prompt, smol

from vmcache import KVSpec, VMKVCache
from vmcache.engine import DraftModel, Engine, NgramDrafter, Request, SamplingParams
from vmcache.hf import PagedCache, VMCache, cache_keyword
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants

NEW = 40  # most answers end (EOS) before this; one or two run to it


pytestmark = pytest.mark.slow  # end to end: scheduled first (tests/conftest.py)


@pytest.fixture(scope="module")
def real():
    model, tok = smol()
    return model, tok, [prompt(tok, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def references(real):
    model, _, prompts = real
    eos = model.generation_config.eos_token_id
    return [generate(model, p, NEW, eos_token_id=eos) for p in prompts]


def vm(model, max_seqs=8, pool_bytes=None, prefix=False):
    spec = KVSpec.from_hf_config(model.config)
    return VMKVCache(spec, max_seqs, 1024, pool_bytes=pool_bytes, prefix_caching=prefix)


def paged(model, max_seqs=8, pool_bytes=64 << 20, prefix=False):
    spec = KVSpec.from_hf_config(model.config)
    return PagedKVCache(spec, pool_bytes=pool_bytes, max_seq_len=1024, max_seqs=max_seqs,
                        prefix_caching=prefix)  # fmt: skip


def test_the_model_answers_and_stops(real, references):
    model, tok, _ = real
    assert model.config.model_type == "llama" and model.config.num_key_value_heads == 3
    assert model.generation_config.eos_token_id == 2
    answer = tok.decode(references[0], skip_special_tokens=True)
    assert "Paris" in answer and references[0][-1] == 2  # "The capital of France is Paris."
    assert sum(r[-1] == 2 for r in references) >= len(references) - 2


def test_the_server_answers_as_generate_and_stops_where_the_model_stops(real, references):
    """The trained model behind the OpenAI-compatible server (its other tests run a random
    2-layer model): each chat answer is greedy generate's, "stop" where the model ended it."""
    from server_cases import chat, client, start

    model, tok, _ = real
    with start((model, tok), "--cache", "vm") as running:
        c = client(running)
        for q, want in zip(QUESTIONS[:3], references):
            r = chat(c, q, max_tokens=NEW)
            assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
            assert r.choices[0].finish_reason == ("stop" if want[-1] == 2 else "length")
    assert any(w[-1] == 2 for w in references[:3])  # the "stop" path was taken


def _left_padded(prompts):
    n = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def test_drop_in_greedy_and_beams_equal_dynamic_cache(real):
    """Both caches against one DynamicCache reference (greedy, then beams)."""
    model, _, prompts = real
    ids, mask = _left_padded(prompts[:4])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    beams = dict(kw, num_beams=3, max_new_tokens=8, attention_mask=mask[:2])
    ref, ref_beams = model.generate(ids, **kw), model.generate(ids[:2], **beams)
    for make in (VMCache, PagedCache):
        cache = make(config=model.config, max_cache_len=ids.shape[1] + 16)
        got = model.generate(ids, **{cache_keyword(model): cache}, **kw)
        assert torch.equal(got, ref), make.__name__
        cache = make(config=model.config, max_cache_len=ids.shape[1] + 8)
        got = model.generate(ids[:2], **{cache_keyword(model): cache}, **beams)
        assert torch.equal(got, ref_beams), make.__name__


def test_drop_in_with_vmcache_attention_equals_dynamic_cache(real):
    model, _, prompts = real
    ids, mask = _left_padded(prompts[:3])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
    ref = model.generate(ids, **kw)
    before = model.config._attn_implementation
    model.set_attn_implementation("vmcache")
    try:
        cache = VMCache(config=model.config, max_cache_len=ids.shape[1] + 20)
        got = model.generate(ids, **{cache_keyword(model): cache}, **kw)
    finally:
        model.set_attn_implementation(before)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_engine_equals_generate_including_where_it_stops(real, references, kind):
    model, _, prompts = real
    engine = Engine(model, vm(model) if kind == "vm" else paged(model))
    reqs = [Request(f"q{i}", tuple(p), SamplingParams(max_new_tokens=NEW))
            for i, p in enumerate(prompts)]  # fmt: skip
    out = engine.run(reqs)
    for i, ref in enumerate(references):
        assert out[f"q{i}"] == [ref]
        want = "stop" if ref[-1] == 2 else "length"
        assert engine.finish_reasons[f"q{i}"] == [want]
    assert model.config._attn_implementation == "sdpa"  # the engine left the model as it was
    check_invariants(engine.kv)


@pytest.fixture(scope="module")
def conversation(real):
    """A multi-turn chat on a long system prompt: each turn's prompt holds every earlier
    turn and answer; (prompts, greedy answers of ``generate``)."""
    from vmcache.models import chat_ids

    model, tok, _ = real
    msgs, prompts, answers = [{"role": "system", "content": SYSTEM}], [], []
    for q in ["Do you sell hammers?", "Which screws suit oak?", "And wood glue?"]:
        msgs.append({"role": "user", "content": q})
        ids = chat_ids(tok, msgs)
        prompts.append(ids)
        answers.append(generate(model, ids, 24, eos_token_id=2))
        text = tok.decode(answers[-1], skip_special_tokens=True)
        msgs.append({"role": "assistant", "content": text})
    return prompts, answers


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_prefix_cache_hits_across_a_multi_turn_chat(real, conversation, kind):
    model, _, _ = real
    prompts, answers = conversation
    make = vm if kind == "vm" else paged
    cached = Engine(model, make(model, prefix=True))
    for i, (p, answer) in enumerate(zip(prompts, answers)):  # turn by turn, as a chat arrives
        req = Request(f"t{i}", tuple(p), SamplingParams(max_new_tokens=16))
        assert cached.run([req])[f"t{i}"] == [answer[:16]]  # generate's own greedy tokens
    hits = cached.stats.prefix_hit_tokens
    tpb = cached.kv.prefix.tokens_per_entry
    # every later turn finds at least the whole blocks of the turn before it
    assert hits >= sum(len(p) // tpb * tpb for p in prompts[:-1]) - tpb
    print(f"{kind}: {hits} of {sum(map(len, prompts))} prompt tokens from the prefix cache "
          f"(blocks of {tpb} tokens)")  # fmt: skip
    check_invariants(cached.kv)


@pytest.mark.parametrize("how", ["chain", "tree", "draft"])
def test_speculation_leaves_greedy_outputs_unchanged(real, references, how):
    model, _, prompts = real
    if how == "draft":  # the target itself as its own draft model, on its own cache
        drafter = DraftModel(model, vm(model), k=3)
    else:
        drafter = NgramDrafter(k=4, branches=1 if how == "chain" else 3)
    engine = Engine(model, vm(model), speculative=drafter)
    reqs = [Request(f"q{i}", tuple(p), SamplingParams(max_new_tokens=NEW))
            for i, p in enumerate(prompts[:4])]  # fmt: skip
    out = engine.run(reqs)
    assert [out[f"q{i}"][0] for i in range(4)] == references[:4]
    assert engine.stats.speculation.proposed > 0
    if how == "draft":  # a draft that is the target is always right
        assert engine.stats.speculation.accepted == engine.stats.speculation.proposed


@pytest.mark.parametrize("policy", ["swap", "recompute"])
def test_preemption_under_a_small_pool_leaves_outputs_unchanged(real, references, policy):
    model, _, prompts = real
    spec = KVSpec.from_hf_config(model.config)
    longest = max(len(p) for p in prompts) + NEW
    pool = 3 * longest * spec.bytes_per_token  # room for about three sequences at once
    engine = Engine(model, paged(model, pool_bytes=pool), preemption=policy)
    reqs = [Request(f"q{i}", tuple(p), SamplingParams(max_new_tokens=NEW))
            for i, p in enumerate(prompts)]  # fmt: skip
    out = engine.run(reqs)
    assert [out[f"q{i}"][0] for i in range(len(prompts))] == references
    st = engine.stats
    assert st.preempt_swap + st.preempt_recompute > 0 or st.max_running < len(prompts)
    check_invariants(engine.kv)
