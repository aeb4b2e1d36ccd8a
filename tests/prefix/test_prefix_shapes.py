"""Prefix caching for every head shape with the default constructor arguments: a token row
that does not divide the page (3 KV heads x 64 x fp32 = 768 bytes, SmolLM2's shape) is shared
in blocks of whole pages that end on a whole token. Both layouts, the host backend and the
CUDA page rules (StrictBackend, 2 MiB granules); the K/V a hit maps are the K/V written."""

import math

import pytest
import torch

from vmcache import KVSpec, VMKVCache
from vmcache.memory.backends.host import HostBackend
from vmcache.memory.backends.strict import StrictBackend
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants

HEAD_DIMS = (64, 80, 96, 128, 256)
KV_HEADS = (1, 2, 3, 5, 6, 8, 12)
STORAGES = {"fp32": (torch.float32, None, "head"), "bf16": (torch.bfloat16, None, "head"),
            "fp8": (torch.bfloat16, torch.float8_e4m3fn, "head"),
            "fp8-token": (torch.bfloat16, torch.float8_e4m3fn, "token")}  # fmt: skip


def spec_of(head_dim, kv_heads, storage, layers=2):
    dtype, kv_dtype, gran = STORAGES[storage]
    return KVSpec(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                  kv_dtype=kv_dtype, kv_granularity=gran)  # fmt: skip


def table_row_bytes(spec, layout):
    return spec.bytes_per_token_per_layer * (spec.num_layers if layout == "token_major" else 1)


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
@pytest.mark.parametrize("strict", [False, True], ids=["host", "cuda-rules"])
def test_every_shape_builds_with_prefix_caching_by_default(layout, strict):
    """The whole grid: defaults only, the block is the least whole-page run ending on a
    token, and the page size is the backend's default (nothing grows the page)."""
    for d in HEAD_DIMS:
        for h in KV_HEADS:
            for storage in STORAGES:
                spec = spec_of(d, h, storage)
                be = StrictBackend(HostBackend()) if strict else None
                with VMKVCache(spec, max_seqs=2, max_seq_len=256, layout=layout, backend=be,
                               own_backend=True, prefix_caching=True) as c:  # fmt: skip
                    u, P = table_row_bytes(spec, layout), c.config.page_bytes
                    ix = c.prefix.index
                    assert ix.pages_per_table == math.lcm(P, u) // P, (d, h, storage)
                    assert ix.tokens_per_entry * u == ix.pages_per_table * P
                    assert P == c._backend.default_page_size


def _kv_of(tokens, spec):
    """K/V that are a function of (token, position): a wrong page shows."""
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    pos = torch.arange(len(tokens), dtype=torch.float32)[:, None, None]
    k = (t / 64 + pos / 4096).expand(len(tokens), spec.num_kv_heads, spec.head_dim)
    return k.to(spec.dtype).contiguous()


def _shared_prompt_hits(c, spec, extra=3):
    tpb = c.prefix.tokens_per_entry
    system = [(7 * i + 3) % 97 for i in range(2 * tpb)]
    a_tokens, b_tokens = system + [1] * extra, system + [2] * extra
    a = c.new_sequence(prefix_tokens=a_tokens)
    c.grow(a, len(a_tokens), token_ids=a_tokens)
    k = _kv_of(a_tokens, spec)
    for layer in range(spec.num_layers):
        c.write(layer, a, 0, k, -k)
    c.prefix.publish(a)
    before = c.stats().physical_pages
    a_kv = [c.kv(layer, a)[0].clone() for layer in range(spec.num_layers)]
    b = c.new_sequence(prefix_tokens=b_tokens)
    hit = c.seq_len(b)
    assert hit == 2 * tpb  # both blocks found
    c.grow(b, len(b_tokens) - hit, token_ids=b_tokens[hit:])
    kb = _kv_of(b_tokens, spec)
    for layer in range(spec.num_layers):
        c.write(layer, b, hit, kb[hit:], -kb[hit:])
    for layer in range(spec.num_layers):
        got_k, got_v = c.kv(layer, b)
        ref = c.kv(layer, a)[0][: 2 * tpb]
        assert torch.equal(got_k[: 2 * tpb], ref)  # the very bytes a wrote
        assert torch.equal(got_v[:hit], -got_k[:hit])
        assert torch.equal(c.kv(layer, a)[0], a_kv[layer])  # b's writes left a's K/V alone
    # only b's own tail was mapped anew: at most one page per table past the shared blocks
    tables = c.prefix.index.pages_per_entry // c.prefix.index.pages_per_table
    assert c.stats().physical_pages - before <= tables
    check_invariants(c)
    c.free(a)
    c.free(b)
    check_invariants(c)
    return hit


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("head_dim, kv_heads", [(64, 3), (80, 5), (96, 6), (64, 12), (128, 8)])
def test_a_hit_maps_the_written_kv_on_the_host(head_dim, kv_heads, storage):
    spec = spec_of(head_dim, kv_heads, storage, layers=1)
    with VMKVCache(spec, max_seqs=4, max_seq_len=1, prefix_caching=True) as probe:
        tpb = probe.prefix.tokens_per_entry
    with VMKVCache(spec, max_seqs=4, max_seq_len=2 * tpb + 8, prefix_caching=True) as c:
        _shared_prompt_hits(c, spec)


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
def test_smollm_shape_under_cuda_page_rules(layout):
    """SmolLM2-135M's K/V shape (3 KV heads x 64, bf16: 384-byte rows) on 2 MiB granules:
    blocks of 3 pages, and the hit reads back the first sequence's K/V."""
    spec = spec_of(64, 3, "bf16", layers=2)
    kw = dict(layout=layout, prefix_caching=True, own_backend=True)
    with VMKVCache(spec, 2, 1, backend=StrictBackend(HostBackend()), **kw) as probe:
        tpb, k = probe.prefix.tokens_per_entry, probe.prefix.index.pages_per_table
    assert k == 3
    with VMKVCache(spec, 4, 2 * tpb + 8, backend=StrictBackend(HostBackend()), **kw) as c:
        _shared_prompt_hits(c, spec)


@pytest.mark.parametrize("head_dim, kv_heads", [(64, 3), (80, 5)])
def test_paged_cache_shares_every_shape_by_default(head_dim, kv_heads):
    spec = spec_of(head_dim, kv_heads, "fp32", layers=1)
    c = PagedKVCache(spec, pool_bytes=64 << 20, max_seq_len=256, max_seqs=4,
                     prefix_caching=True)  # fmt: skip
    assert c.prefix.index.pages_per_table == 1
    _shared_prompt_hits(c, spec)


def test_the_drop_in_takes_prefix_caching_with_defaults_on_smollms_shape():
    from transformers import LlamaConfig, LlamaForCausalLM

    from vmcache.hf import VMCache, cache_keyword

    cfg = LlamaConfig(vocab_size=128, hidden_size=576, intermediate_size=256, head_dim=64,
                      num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    kw = dict(do_sample=False, max_new_tokens=8, pad_token_id=0,
              attention_mask=torch.ones_like(ids))  # fmt: skip
    ref = model.generate(ids, **kw)
    cache = VMCache(config=model.config, max_cache_len=64, prefix_caching=True)
    got = model.generate(ids, **{cache_keyword(model): cache}, **kw)
    assert torch.equal(got, ref) and cache.kv.prefix.index.pages_per_table == 3
