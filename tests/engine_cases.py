"""The engine tests' tiny model and caches (tests/engine/ and the tests that run an engine on
the same 2-layer Llama): its config and K/V spec, the module-scoped model fixture, caches by
kind and page budget, random requests, and greedy references from transformers' generate
on an SDPA twin of the same weights."""

import copy

import pytest
import torch
from caches import strict_host
from transformers import LlamaConfig, LlamaForCausalLM

from vmcache import KVSpec, VMKVCache
from vmcache.engine import Request, SamplingParams
from vmcache.paged_fallback import PagedKVCache

CFG = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip
SPEC = KVSpec.from_hf_config(CFG)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(copy.deepcopy(CFG)).eval()
    m.generation_config.eos_token_id = None  # the engine's requests carry no stop token
    return m


def make(kind, pages):
    if kind == "vm":  # 4 KiB pages: 32 tokens of one layer's K (or V) per page
        return VMKVCache(
            SPEC,
            8,
            128,
            page_size=4096,
            backend=strict_host(),
            own_backend=True,
            pool_bytes=pages * 4096,
        )
    return PagedKVCache(SPEC, num_blocks=pages, block_size=16, max_seq_len=128, max_seqs=8)


def prefix_vm(pages, max_seqs=8):
    return VMKVCache(SPEC, max_seqs, 128, page_size=4096, backend=strict_host(),
                     own_backend=True, pool_bytes=pages * 4096, prefix_caching=True)  # fmt: skip


def requests(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = lambda n: tuple(torch.randint(0, 128, (n,), generator=g).tolist())
    return [Request(f"r{i}", prompt(n), SamplingParams(max_new_tokens=m))
            for i, (n, m) in enumerate(shape)]  # fmt: skip


_TWINS: dict = {}


def sdpa_twin(model):
    """The same weights in a model that runs transformers' own SDPA attention: the engine
    switches the model it gets to attn "vmcache", so the reference must not share it."""
    if id(model) not in _TWINS:
        cfg = copy.deepcopy(CFG)  # its own config: the engine switches the model's
        twin = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
        twin.load_state_dict(model.state_dict())
        twin.generation_config.eos_token_id = None
        _TWINS[id(model)] = twin
    twin = _TWINS[id(model)]
    assert twin.config._attn_implementation == "sdpa"
    return twin


def reference(model, reqs):
    twin = sdpa_twin(model)
    return {r.req_id: twin.generate(torch.tensor([r.prompt]), do_sample=False,
                                    max_new_tokens=r.params.max_new_tokens)[0, len(r.prompt):]
            .tolist() for r in reqs}  # fmt: skip


MIXED = [(10, 12), (33, 8), (5, 20), (50, 6), (17, 15)]
LONG = [(20, 50)] * 5  # grows past the watermark: the small pools must preempt


def penalized_greedy(model, prompt, new, *, freq=0.0, pres=0.0, bias=None):
    """Greedy decoding with OpenAI's penalties and bias, one full forward per token."""
    ids, out = list(prompt), []
    for _ in range(new):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1].float()
        for t, b in (bias or {}).items():
            row[t] += b
        for t in set(out):
            row[t] -= freq * out.count(t) + pres
        out.append(int(row.argmax()))
        ids.append(out[-1])
    return out
