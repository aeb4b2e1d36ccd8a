"""The CPU step built from one decoder layer (vmcache.engine.layered): the linear groups it
finds, what it refuses (then the whole model's graph is built), one package serving any weights
of the architecture, a model with biased projections, and the user's modules back after every
step, a failed one too. (The tokens against the eager step on both caches:
tests/engine/test_engine_compiled.py.)"""

import copy

import pytest
import torch
from engine_cases import CFG, make, requests
from transformers import Qwen2Config, Qwen2ForCausalLM

from vmcache import KVSpec, VMKVCache
from vmcache.engine import Engine, layered
from vmcache.engine.packaged import package_key
from vmcache.kernels import cpu_gemm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_gemm.available()[0], reason="the CPU GEMM kernel does not build"),
]


def outputs(engine, reqs):
    out = engine.run(copy.deepcopy(reqs))
    return {r.req_id: out[r.req_id] for r in reqs}


def llama(seed):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = copy.deepcopy(CFG)
    cfg.initializer_range = 0.2  # logits far apart: greedy ties cannot flip on rounding
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = None
    return m


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A model's step built from one layer into a private directory: → (model, directory)."""
    model = llama(0)
    where = tmp_path_factory.mktemp("layered")
    where.chmod(0o700)
    engine = Engine(model, make("vm", 40), compile=True, compile_cache=where)
    assert engine.runner.layered and engine.runner.compiles == 1
    return model, where


def test_the_linears_that_read_one_input_are_one_group(built):
    model, _ = built
    runner = Engine(model, make("vm", 40), compile=True, compile_cache=built[1]).runner
    assert runner._graph.groups == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]  # fmt: skip


def test_what_it_refuses_says_why():
    model = llama(0)
    assert layered.unsupported(model) is None
    uneven = copy.deepcopy(model)
    uneven.model.layers[1].mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(CFG.hidden_size))
    assert "different" in layered.unsupported(uneven)
    assert "float32" in layered.unsupported(copy.deepcopy(model).to(torch.bfloat16))
    headless = copy.deepcopy(model)
    headless.lm_head = torch.nn.Identity()
    assert "lm_head" in layered.unsupported(headless)


def test_one_package_serves_any_weights_of_the_architecture(built):
    """The package holds no weights: a model of the same config with other weights loads it
    (nothing compiles) and gets its own tokens, not the first model's."""
    model, where = built
    other = llama(1)
    assert package_key(model, torch.float32, {}, weights=False) == package_key(
        other, torch.float32, {}, weights=False)  # fmt: skip
    assert package_key(model, torch.float32, {}) != package_key(other, torch.float32, {})
    reqs = requests([(9, 6), (3, 6), (20, 4)], seed=5)
    engine = Engine(other, make("vm", 40), compile=True, compile_cache=where)
    assert engine.runner.layered and engine.runner.compiles == 0
    got = outputs(engine, reqs)
    assert got == outputs(Engine(other, make("vm", 40)), reqs)
    assert got != outputs(Engine(model, make("vm", 40)), reqs)


def test_the_users_modules_come_back_after_every_step(built):
    model, where = built
    layers, head = model.model.layers, model.lm_head
    engine = Engine(model, make("paged", 40), compile=True, compile_cache=where)
    engine.run(requests([(5, 3)], seed=2))
    assert model.model.layers is layers and model.lm_head is head
    runner = engine.runner
    bad = torch.zeros(8, dtype=torch.float64)  # a storage the compiled layer refuses
    args = (torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
            torch.tensor([1]), bad, runner.layout, torch.arange(2),
            torch.zeros(1, 2, dtype=torch.long), torch.tensor([[2], [2]]))  # fmt: skip
    with pytest.raises(Exception):  # noqa: B017 - whatever the compiled code raises
        runner._graph(*args)
    assert model.model.layers is layers and model.lm_head is head
    assert model.config._attn_implementation != "vmcache_compiled_step"
    assert all(type(m) is not layered._LayerCall for m in model.modules())


def test_biased_projections_stack_their_biases(tmp_path):
    """Qwen2's q, k and v carry biases (o does not): one GEMM with the biases stacked, the
    eager step's tokens on both caches."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, initializer_range=0.2)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.normal_()  # (initialized to zeros)
    spec = KVSpec.from_hf_config(cfg)
    kv = lambda: VMKVCache(spec, 8, 128, page_size=4096, pool_bytes=40 * 4096)  # noqa: E731
    reqs = requests([(9, 6), (30, 5), (2, 8)], seed=4)
    tmp_path.chmod(0o700)
    engine = Engine(model, kv(), compile=True, compile_cache=tmp_path)
    assert engine.runner.layered
    assert outputs(engine, reqs) == outputs(Engine(model, kv()), reqs)


def test_a_profile_sees_the_lm_head_as_a_linear_layer(built):
    """The lm_head's GEMM, run outside the package, goes through the dispatcher: torch's
    profiler records it as ``vmcache::packed_linear`` (a direct call of the C kernel recorded
    nothing, and bench-vllm-profile counted its time as the model's own)."""
    model, where = built
    engine = Engine(model, make("vm", 40), compile=True, compile_cache=where)
    panels = -(-model.config.vocab_size // cpu_gemm.NB)
    with torch.profiler.profile(record_shapes=True) as prof:
        engine.run(requests([(5, 3)], seed=2))
    heads = [e for e in prof.events() if e.name == "vmcache::packed_linear"
             and e.input_shapes and e.input_shapes[1][:1] == [panels]]  # fmt: skip
    assert len(heads) == 3  # one a step: the prompt's, then two decodes
