"""The engine over FP8 K/V: both caches run packed prefills and decodes (with preemption on a
small pool and speculation) and give the tokens the drop-in gives with the same storage, so
the engine's writes, reads and kernels quantize exactly as the cache's own interface does."""

import dataclasses

import pytest
import torch
from caches import strict_host
from engine_cases import LONG, SPEC, requests

from vmcache import VMKVCache
from vmcache.engine import Engine, NgramDrafter
from vmcache.hf import VMCache
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants

FP8 = dataclasses.replace(SPEC, kv_dtype=torch.float8_e4m3fn)
INT8_TOKEN = dataclasses.replace(SPEC, kv_dtype=torch.int8, kv_granularity="token")


def make(kind, pages, spec=FP8):
    if kind == "vm":
        return VMKVCache(spec, 8, 128, page_size=4096, backend=strict_host(), own_backend=True,
                         pool_bytes=pages * 4096)  # fmt: skip
    return PagedKVCache(spec, num_blocks=pages, block_size=16, max_seq_len=128, max_seqs=8)


@pytest.mark.parametrize(
    "kind,pages,spec",
    [
        ("vm", 24, FP8),
        ("paged", 40, FP8),
        ("vm", 10, FP8),
        ("vm", 24, INT8_TOKEN),
        ("paged", 40, INT8_TOKEN),
    ],
)
def test_the_engine_over_fp8_kv_gives_the_drop_ins_tokens(model, kind, pages, spec):
    reqs = requests(LONG, seed=2)
    engine = Engine(model, make(kind, pages, spec), speculative=NgramDrafter(k=3))
    out = engine.run(reqs)
    check_invariants(engine.kv)
    scales = 2 * SPEC.num_layers * spec.scale_bytes_per_token_per_layer
    assert engine.kv.spec.bytes_per_token == SPEC.bytes_per_token // 4 + scales  # fp32 → 1 B
    for r in reqs:
        cache = VMCache(model.config, 128, 1, kv_dtype=spec.kv_dtype,
                        kv_granularity=spec.kv_granularity)  # fmt: skip
        want = model.generate(
            torch.tensor([r.prompt]),
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=r.params.max_new_tokens,
        )[0, len(r.prompt) :]
        assert out[r.req_id] == [want.tolist()], r.req_id  # fmt: skip
