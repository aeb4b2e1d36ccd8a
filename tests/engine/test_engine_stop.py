"""Where generation stops, and what the engine leaves of the user's model: the model's
end-of-sequence ids stop a sequence by default (as ``generate`` does: the same tokens, the
EOS kept), ``ignore_eos`` and ``stop_token_ids`` change that, each output says why it
finished; top_p / min_p filter like transformers; the model object keeps its attention
implementation, so its own ``generate`` and ``generate_batch`` still run after the engine."""

import copy

import pytest
import torch
from caches import strict_host
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from vmcache import KVSpec, VMKVCache
from vmcache.engine import Engine, Request, SamplingParams
from vmcache.engine.drafts import target_probs
from vmcache.sequences.invariants import check_invariants

CFG = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip
SPEC = KVSpec.from_hf_config(CFG)
PROMPTS = [tuple((7 * i + 3 * j) % 128 for j in range(9 + 5 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(copy.deepcopy(CFG)).eval()


def cache():
    return VMKVCache(SPEC, 8, 128, page_size=4096, backend=strict_host(), own_backend=True,
                     pool_bytes=200 * 4096)  # fmt: skip


def generate(model, prompt, new, eos):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new, eos_token_id=eos, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_the_models_eos_stops_where_generate_stops(model):
    # an EOS that greedy decoding reaches for some prompts and not for others
    runs = {p: generate(model, p, 24, None) for p in PROMPTS}
    eos = runs[PROMPTS[0]][5]
    model.generation_config.eos_token_id = eos
    try:
        engine = Engine(model, cache())
        assert engine.eos_token_ids == {eos}
        reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=24))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
        out = engine.run(reqs)
        stopped = 0
        for i, p in enumerate(PROMPTS):
            ref = generate(model, p, 24, eos)
            assert out[f"r{i}"] == [ref]  # token for token, the EOS included
            reason = "stop" if eos in ref else "length"
            assert engine.finish_reasons[f"r{i}"] == [reason]
            stopped += reason == "stop"
        assert 1 <= stopped < len(PROMPTS)
        ignore = SamplingParams(max_new_tokens=24, ignore_eos=True)
        again = Engine(model, cache()).run([Request("x", PROMPTS[0], ignore)])["x"][0]
        assert again == runs[PROMPTS[0]] and len(again) == 24
        check_invariants(engine.kv)
        assert not engine.kv.sequences and engine.kv.stats().physical_pages == 0
    finally:
        model.generation_config.eos_token_id = None


def test_an_eos_list_and_extra_stop_ids(model):
    free = generate(model, PROMPTS[1], 20, None)
    model.generation_config.eos_token_id = [free[9], free[3]]
    try:
        engine = Engine(model, cache())
        assert engine.eos_token_ids == {free[9], free[3]}
        out = engine.run([Request("a", PROMPTS[1], SamplingParams(max_new_tokens=20))])["a"][0]
        assert out == free[: free.index(free[3]) + 1]
        extra = SamplingParams(max_new_tokens=20, stop_token_ids=[free[1]], ignore_eos=True)
        e2 = Engine(model, cache())
        out = e2.run([Request("b", PROMPTS[1], extra)])["b"][0]
        assert out == free[: free.index(free[1]) + 1] and e2.finish_reasons["b"] == ["stop"]
    finally:
        model.generation_config.eos_token_id = None


def test_bad_stop_and_filter_values_are_refused():
    for kw, err in [({"top_p": 0.0}, ValueError), ({"top_p": 1.5}, ValueError),
                    ({"min_p": -0.1}, ValueError), ({"min_p": 2.0}, ValueError),
                    ({"temperature": float("inf")}, ValueError),
                    ({"temperature": float("nan")}, ValueError),
                    ({"stop_token_ids": 5}, TypeError), ({"stop_token_ids": "ab"}, TypeError),
                    ({"stop_token_ids": [1, -2]}, TypeError),
                    ({"ignore_eos": 1}, TypeError), ({"top_p": "0.5"}, TypeError)]:  # fmt: skip
        with pytest.raises(err):
            SamplingParams(**kw)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_a_stop_id_outside_the_vocabulary_is_refused(model):
    engine = Engine(model, cache())
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request(Request("a", (1, 2), SamplingParams(stop_token_ids=[128])))
    assert not engine.outputs and not engine.scheduler.has_work()


def test_top_p_and_min_p_filter_as_transformers_does():
    from transformers.generation import logits_process as lp

    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(50, generator=g) * 3
        for t, k, p, m in [(0.7, 0, 0.9, 0.0), (1.3, 10, 0.5, 0.0), (1.0, 0, 1.0, 0.2),
                           (0.9, 20, 0.8, 0.1)]:  # fmt: skip
            ref = lp.TemperatureLogitsWarper(t)(None, logits[None].clone())
            if k:
                ref = lp.TopKLogitsWarper(k)(None, ref)
            if p < 1:
                ref = lp.TopPLogitsWarper(p)(None, ref)
            if m:
                ref = lp.MinPLogitsWarper(m)(None, ref)
            ref = ref.softmax(-1)[0]
            got = target_probs(logits, t, k, p, m)
            assert torch.equal(got > 0, ref > 0)  # the same tokens survive
            assert torch.allclose(got, ref, atol=1e-6)


def test_the_engine_leaves_the_models_attention_alone(model):
    model.config._attn_implementation = "sdpa"
    before = generate(model, PROMPTS[2], 8, None)
    engine = Engine(model, cache())
    out = engine.run([Request("a", PROMPTS[2], SamplingParams(max_new_tokens=8))])["a"][0]
    assert out == before
    assert model.config._attn_implementation == "sdpa"
    assert all(getattr(m, "config", model.config)._attn_implementation == "sdpa"
               for m in model.model.layers.modules() if hasattr(m, "config"))  # fmt: skip
    assert generate(model, PROMPTS[2], 8, None) == before  # its own generate, as before
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    # a bounded cache: unsized, continuous batching sizes its cache from free memory (a minute
    # of page faults on this CPU before the first token)
    bounded = ContinuousBatchingConfig(num_blocks=4, max_batch_tokens=64)
    batch = model.generate_batch(inputs=[list(PROMPTS[2])], generation_config=gc,
                                 continuous_batching_config=bounded)  # fmt: skip
    (res,) = batch.values()
    assert list(res.generated_tokens) == before  # transformers' continuous batching runs too
    # a step that fails midway restores the attention implementation all the same
    engine.runner.inner = None
    s = engine.kv.new_sequence()
    engine.kv.grow(s, 2)  # the runner's contract: the step's sequences are grown first
    with pytest.raises(AttributeError):
        engine.runner.step([s], [0], [[1, 2]])
    assert model.config._attn_implementation == "sdpa"


def test_sampling_without_a_seed_is_fresh_and_any_int64_seed_reproduces(model):
    kv = VMKVCache(KVSpec.from_hf_config(model.config), 4, 64, pool_bytes=1 << 20)
    engine = Engine(model, kv)
    draw = lambda rid, **kw: engine.run([Request(rid, (3, 4, 5), SamplingParams(
        max_new_tokens=12, temperature=1.0, ignore_eos=True, **kw))])[rid][0]  # fmt: skip
    assert draw("a") != draw("b")  # 12 tokens drawn from a wide distribution twice
    for seed in (-(2**63), -1, 2**63 - 1):
        assert draw(f"s{seed}", seed=seed) == draw(f"t{seed}", seed=seed)
    with pytest.raises(TypeError, match="seed"):
        SamplingParams(seed=1.5)
    kv.close()
