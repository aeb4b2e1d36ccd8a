"""FP8 / INT8 K/V on the GPU (H200: FP8 native): the compiled Triton decode against the
reference over what each cache stores, with head and per-token scales, over lengths on and
past page edges and several split-K partitions; the Triton prefill (the default) and SDPA over
dequantized copies; the FlashAttention impls refused; and the engine over FP8 on both caches.
Skipped without a GPU."""

import pytest
import torch
from cuda_cases import LENS
from cuda_cases import fill_on_gpu as cuda_fill

from vmcache import KVSpec, VMKVCache, kernels
from vmcache.kernels import contiguous
from vmcache.kernels.reference import dense_attention
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants

pytestmark = pytest.mark.gpu

STORAGES = [(torch.float8_e4m3fn, "head"), (torch.float8_e5m2, "head"), (torch.int8, "head"),
            (torch.float8_e4m3fn, "token"), (torch.int8, "token")]  # fmt: skip
TOL = dict(rtol=1e-2, atol=1e-2)  # bf16 q and output against an fp32 reference


def _spec(kv_dtype, granularity, layers=2):
    scales = None
    if granularity == "head":  # amax of a unit normal over these sizes ≈ 5: INT8 needs it
        scales = tuple((5.0 / 127 if kv_dtype == torch.int8 else 1.0) * (1 + 0.05 * i)
                       for i in range(2 * layers * 8))  # fmt: skip
    return KVSpec(layers, 8, 128, torch.bfloat16, num_q_heads=32, kv_dtype=kv_dtype,
                  kv_scales=scales, kv_granularity=granularity)  # fmt: skip


def _fill(kind, spec, lens=LENS):
    """test_cuda's caches and K/V over quantized storage; what each stores (dequantized) is
    within one quantization step of what was written."""
    cache, seqs, written = cuda_fill(kind, spec, lens)
    step = 0.07 if spec.kv_dtype == torch.float8_e4m3fn else 0.14
    for (s, layer), (k, _) in written.items():
        held_k = cache.kv(layer, s)[0].float().cpu()
        assert (held_k - k.float()).abs().max() <= step * k.float().abs().max()
    return cache, seqs


@pytest.mark.parametrize("kv_dtype,granularity", STORAGES)
@pytest.mark.parametrize("kind", ["vm", "vm_token_major", "paged"])
def test_compiled_quantized_decode_matches_the_reference(kind, kv_dtype, granularity):
    spec = _spec(kv_dtype, granularity)
    cache, seqs = _fill(kind, spec)
    q = torch.randn(len(seqs), 32, 128, device="cuda").to(torch.bfloat16)
    for layer in range(2):
        ref = torch.stack([dense_attention(q[i : i + 1].float(),
                                           *(x.float() for x in cache.kv(layer, s)))[0]
                           for i, s in enumerate(seqs)])  # fmt: skip
        for impl in ("triton", "sdpa"):
            out = kernels.decode(cache, layer, q, seqs, impl=impl).float()
            torch.testing.assert_close(out, ref, **TOL, msg=f"{impl} layer {layer}")
    if kind != "paged":
        assert contiguous.available_impls(q, quantized=True)[0] == "triton"
        with pytest.raises(ValueError, match="FP8/INT8"):
            kernels.decode(cache, 0, q, seqs, impl="aten_fa2")
    cache.close()


@pytest.mark.parametrize("granularity", ["head", "token"])
@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_quantized_prefill_reads_the_bytes_in_triton_and_dequantizes_for_sdpa(kind, granularity):
    spec = _spec(torch.float8_e4m3fn, granularity)
    cache, seqs = _fill(kind, spec, [5, 600, 2049])
    q_lens = [3, 17, 64]
    q = torch.randn(sum(q_lens), 32, 128, device="cuda").to(torch.bfloat16)
    for impl in ("triton", "sdpa", None):
        out = kernels.prefill(cache, 1, q, seqs, q_lens, impl=impl).float()
        start = 0
        for s, n in zip(seqs, q_lens):
            k, v = cache.kv(1, s)
            want = dense_attention(q[start : start + n].float(), k.float(), v.float())
            torch.testing.assert_close(out[start : start + n], want, **TOL, msg=str(impl))
            start += n
    cache.close()


@pytest.mark.parametrize("granularity", ["head", "token"])
def test_the_engine_over_fp8_on_the_gpu_agrees_across_caches(granularity):
    """Both caches store the same bytes; only the kernels' summation order differs, so their
    greedy tokens agree almost everywhere (a random model has near ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vmcache.engine import Engine, Request, SamplingParams

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    spec = KVSpec.from_hf_config(
        cfg, torch.bfloat16, torch.float8_e4m3fn, kv_granularity=granularity
    )
    g = torch.Generator().manual_seed(3)
    reqs = [Request(f"r{i}", tuple(torch.randint(0, 512, (40 + 9 * i,), generator=g).tolist()),
                    SamplingParams(max_new_tokens=24)) for i in range(6)]  # fmt: skip
    outs = []
    for kv in (VMKVCache(spec, 8, 256, device="cuda"),
               PagedKVCache(spec, num_blocks=128, block_size=16, device="cuda",
                            max_seq_len=256, max_seqs=8)):  # fmt: skip
        engine = Engine(model, kv)
        outs.append(engine.run(reqs))
        check_invariants(kv)
        assert engine.stats.as_dict()["generated_tokens"] == 6 * 24
    same = sum(a == b for r in reqs for a, b in zip(outs[0][r.req_id][0], outs[1][r.req_id][0]))
    assert same >= 0.9 * 6 * 24
