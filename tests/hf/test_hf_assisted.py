"""Speculative decoding inside transformers' generate with our caches: assisted decoding with a
draft model (assistant_model=) and prompt lookup (prompt_lookup_num_tokens=) give exactly the
tokens transformers' own cache gives (greedy), and the crops that roll rejected drafts back
return their pages."""

import copy

import pytest
import torch
from hf_cases import CACHES, KW, MODELS, gen, model, prompts
from transformers import LlamaForCausalLM

from vmcache.sequences.invariants import check_invariants


def draft_model():
    """A smaller model of the same vocabulary: its drafts are often wrong (rollbacks happen)."""
    cls, cfg = MODELS["llama_gqa"]
    cfg = copy.deepcopy(cfg)
    cfg.num_hidden_layers = 1
    torch.manual_seed(1)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_assisted_decoding_with_a_draft_model_equals_dynamic_cache(kind):
    m, draft = model("llama_gqa"), draft_model()
    ids = prompts([14])[0]
    kw = dict(input_ids=ids, max_new_tokens=24, do_sample=False)
    want = gen(m, assistant_model=draft, **kw)
    assert torch.equal(want, gen(m, **kw))  # greedy assisted decoding is the target's greedy
    cache = CACHES[kind](m, 128)
    got = gen(m, cache, assistant_model=draft, **kw)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == want.shape[1] - 1
    check_invariants(cache.kv)
    mapped = cache.kv.stats().physical_pages
    assert mapped <= cache.kv.capacity.pages_for_tokens(
        want.shape[1]
    )  # rejected drafts' pages returned


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_prompt_lookup_crops_return_their_pages(kind):
    m = model("llama_gqa")
    ids = torch.tensor([list(range(10, 22)) * 3])
    kw = dict(input_ids=ids, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=4)
    want = gen(m, **kw)
    cache = CACHES[kind](m, 128)
    got = gen(m, cache, **kw)
    assert torch.equal(got, want)
    assert cache.kv.stats().physical_pages <= cache.kv.capacity.pages_for_tokens(want.shape[1])
    check_invariants(cache.kv)
    assert KW in ("cache", "past_key_values")
