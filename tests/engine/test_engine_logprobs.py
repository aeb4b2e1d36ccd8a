"""What the engine reports of the model's distribution and what it does to it before sampling:
log-probabilities of generated and prompt tokens (with their rank and top alternatives) equal
to a teacher-forced forward pass of the model itself, over chunked prefills, prefix caching
and forks; repetition penalty equal to transformers' ``generate``; frequency and presence
penalties and logit bias equal to a plain reference; bad values refused before anything
changes. Both caches."""

import copy

import pytest
import torch
from caches import paged, vm
from engine_cases import penalized_greedy
from transformers import LlamaConfig, LlamaForCausalLM

from vmcache import KVSpec
from vmcache.engine import Engine, NgramDrafter, Request, SamplingParams
from vmcache.sequences.invariants import check_invariants

CFG = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip
SPEC = KVSpec.from_hf_config(CFG)
PROMPT = tuple((5 * j + 3) % 128 for j in range(45))  # 45: awkward against 16- and 32-token units


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(copy.deepcopy(CFG)).eval()


def cache(kind, prefix=False):
    make = vm if kind == "vm" else paged
    kw = {"blocks": 64} if kind == "paged" else {"pages": 128}
    return make(spec=SPEC, prefix_caching=prefix, **kw)


@torch.no_grad()
def teacher_forced(model, ids) -> torch.Tensor:
    """fp32 ``[len(ids), V]``: log_softmax of the model's logits over ``ids`` in one forward."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def run(model, kind, reqs, **kw):
    engine = Engine(model, cache(kind, **kw.pop("cache_kw", {})), **kw)
    engine.run(reqs)
    check_invariants(engine.kv)
    return engine


def check_reports(reports, lp, tokens, k):
    """Each report's logprob, rank and top-k against the teacher-forced ``lp`` rows."""
    assert len(reports) == len(tokens)
    for r, row, t in zip(reports, lp, tokens):
        assert r.token == t and abs(r.logprob - float(row[t])) < 1e-4
        assert r.rank == int((row > row[t]).sum()) + 1
        want = row.topk(k)
        assert [i for i, _ in r.top] == want.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in r.top]), want.values, atol=1e-4)


@pytest.mark.parametrize("kind", ["vm", "paged"])
@pytest.mark.parametrize("chunk", [2048, 16])
def test_generated_and_prompt_logprobs_are_the_models_teacher_forced_ones(model, kind, chunk):
    params = SamplingParams(max_new_tokens=12, logprobs=3, prompt_logprobs=5, ignore_eos=True)
    engine = Engine(model, cache(kind), max_batch_tokens=chunk)
    engine.add_request(Request("a", PROMPT, params))
    while engine.scheduler.has_work():
        engine.step()
    out = engine.outputs["a"][0]
    lp = teacher_forced(model, [*PROMPT, *out])
    prompt_reports = engine.records.prompt_logprobs("a")
    assert prompt_reports[0] is None and len(prompt_reports) == len(PROMPT)
    check_reports(prompt_reports[1:], lp[: len(PROMPT) - 1], PROMPT[1:], 5)
    gen = engine.records.logprobs("a", 0, 0, len(out))
    check_reports(gen, lp[len(PROMPT) - 1 : -1], out, 3)
    assert all(r.rank == 1 for r in gen)  # greedy: the most likely token each time
    check_invariants(engine.kv)


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_a_cached_prefix_is_recomputed_for_prompt_logprobs_only(model, kind):
    first = Request("a", PROMPT, SamplingParams(max_new_tokens=2))
    again = Request("b", PROMPT, SamplingParams(max_new_tokens=2, prompt_logprobs=0))
    plain = Request("c", PROMPT, SamplingParams(max_new_tokens=2))
    engine = Engine(model, cache(kind, prefix=True))
    for r in (first, again, plain):  # one after another: each finds the others' pages
        engine.add_request(r)
        while engine.scheduler.has_work():
            engine.step()
    assert engine.records.prefix_hit("b") == 0 and engine.records.prefix_hit("c") >= 16
    reports = engine.records.prompt_logprobs("b")
    lp = teacher_forced(model, list(PROMPT))
    check_reports(reports[1:], lp[:-1], PROMPT[1:], 0)
    assert engine.outputs["a"] == engine.outputs["b"] == engine.outputs["c"]


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_sampled_forks_report_their_own_tokens(model, kind):
    params = SamplingParams(max_new_tokens=8, n=3, temperature=1.0, seed=3, logprobs=2,
                            ignore_eos=True)  # fmt: skip
    engine = run(model, kind, [Request("a", PROMPT, params)])
    outs = engine.outputs["a"]
    assert len({tuple(o) for o in outs}) > 1  # sampled: the forks differ
    for i, out in enumerate(outs):
        lp = teacher_forced(model, [*PROMPT, *out])
        check_reports(engine.records.logprobs("a", i, 0, 8), lp[len(PROMPT) - 1 : -1], out, 2)


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_penalties_and_bias_equal_plain_references(model, kind):
    plain = penalized_greedy(model, PROMPT, 16)
    banned = plain[0]
    cases = {  # name: (params, reference)
        "freq": (dict(frequency_penalty=1.5), dict(freq=1.5)),
        "pres": (dict(presence_penalty=2.0), dict(pres=2.0)),
        "both": (dict(frequency_penalty=-0.5, presence_penalty=1.0), dict(freq=-0.5, pres=1.0)),
        "bias": (dict(logit_bias={banned: -100, 7: 3.5}), dict(bias={banned: -100, 7: 3.5})),
    }
    reqs = [Request(name, PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True, **p))
            for name, (p, _) in cases.items()]  # fmt: skip
    reqs.append(Request("plain", PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True)))
    engine = run(model, kind, reqs)
    assert engine.outputs["plain"][0] == plain
    for name, (_, ref) in cases.items():
        assert engine.outputs[name][0] == penalized_greedy(model, PROMPT, 16, **ref), name
    assert banned not in engine.outputs["bias"][0]
    assert len(set(engine.outputs["freq"][0])) > len(set(plain))  # it did change something


def test_repetition_penalty_equals_transformers_generate(model):
    ids = torch.tensor([PROMPT])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=16, repetition_penalty=1.3, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT) :].tolist()  # fmt: skip
    params = SamplingParams(max_new_tokens=16, repetition_penalty=1.3, ignore_eos=True)
    engine = run(model, "vm", [Request("a", PROMPT, params)])
    assert engine.outputs["a"][0] == want


@pytest.mark.parametrize("kwargs,error", [
    (dict(logprobs=21), ValueError), (dict(logprobs=-1), ValueError),
    (dict(prompt_logprobs=1.5), TypeError), (dict(presence_penalty=2.5), ValueError),
    (dict(frequency_penalty=float("nan")), ValueError), (dict(repetition_penalty=0), ValueError),
    (dict(logit_bias={3: 101}), ValueError), (dict(logit_bias={-1: 1}), TypeError),
    (dict(logit_bias={"3": 1}), TypeError), (dict(logit_bias="x"), TypeError),
    (dict(logit_bias={i: 1 for i in range(301)}), ValueError),
])  # fmt: skip
def test_bad_values_are_refused(kwargs, error):
    with pytest.raises(error):
        SamplingParams(**kwargs)


def test_the_engine_refuses_what_it_cannot_serve_and_changes_nothing(model):
    engine = Engine(model, cache("vm"))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(Request("a", PROMPT, SamplingParams(logit_bias={128: 1.0})))
    spec = Engine(model, cache("vm"), speculative=NgramDrafter(k=2))
    with pytest.raises(ValueError, match="speculative"):
        spec.add_request(Request("a", PROMPT, SamplingParams(logprobs=1)))
    assert not engine.outputs and not spec.outputs
    assert SamplingParams(logit_bias=[[5, 1], [2, -1]]).logit_bias == ((2, -1.0), (5, 1.0))
