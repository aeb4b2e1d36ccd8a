"""The compiled engine step (Engine(compile=True), vmcache.engine.compiled): the same tokens
as the eager step on both caches, under preemption and prefix caching; one graph, built at
warm-up and never again while batches, lengths and pages change; the operator it calls
against the eager batched kernel; a clear refusal where it cannot compile."""

import copy

import pytest
import torch
from caches import strict_host
from engine_cases import CFG, SPEC, make, prefix_vm, requests
from torch._inductor.custom_graph_pass import CustomGraphPass
from transformers import LlamaForCausalLM

from vmcache import KVSpec, VMKVCache, kernels
from vmcache.engine import Engine, NgramDrafter, Request, SamplingParams
from vmcache.engine.compiled import CompiledRunner, unsupported
from vmcache.kernels import cpu_decode, cpu_decode_plan, cpu_gemm, step_op
from vmcache.kernels.reference import dense_attention
from vmcache.kernels.step_op import step_attention
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.batch import layout_of, store_of
from vmcache.sequences.invariants import check_invariants

pytestmark = pytest.mark.slow  # end to end: scheduled first (tests/conftest.py)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = copy.deepcopy(CFG)
    cfg.initializer_range = 0.2  # logits far apart: greedy ties cannot flip on rounding
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = None
    return m


# prompts of 1 to 40 tokens, 1 to 12 new: batches grow and shrink to one sequence (a lone
# decode), prefills and decodes share steps
SHAPES = [(1, 6), (7, 12), (40, 3), (17, 9), (2, 1), (33, 10), (5, 12)]


def outputs(engine, reqs):
    out = engine.run(copy.deepcopy(reqs))
    return {r.req_id: out[r.req_id] for r in reqs}


@pytest.mark.parametrize("kind,pages", [("vm", 40), ("paged", 40), ("vm", 10), ("paged", 8)])
def test_compiled_tokens_equal_eager_and_nothing_recompiles(model, steps, kind, pages):
    """Few pages: preemption (recompute) re-prefills sequences mid-run, so the graph sees
    prefills after decodes, lone decodes, and every batch size from 1 up."""
    reqs = requests(SHAPES, seed=3)
    want = outputs(Engine(model, make(kind, pages)), reqs)
    kv = make(kind, pages)
    engine = Engine(model, kv, compile=True, compile_cache=steps)
    warm = engine.runner.compiles
    assert warm == 0  # the module's package (the compiled fixture), loaded: nothing compiled
    got = outputs(engine, reqs)
    assert got == want
    assert engine.runner.compiles == warm  # no recompilation after warm-up
    assert engine.stats.steps > len(SHAPES)
    check_invariants(kv)
    assert model.config._attn_implementation != "vmcache_compiled_step"  # restored


class _CountGemms(CustomGraphPass):
    """inductor's last graph pass: counts the GEMMs in the graphs it lowers, the calls of
    vmcache's packed linear (where its kernel builds) or the weights packed for oneDNN (one a
    GEMM: some GEMMs are lowered already, fused with an add)."""

    def __init__(self) -> None:
        self.gemms = 0

    def __call__(self, graph) -> None:
        self.gemms += sum((n.op == "get_attr" and n.name.startswith("_reorder_linear_weight"))
                          or n.target is torch.ops.vmcache.packed_linear.default
                          for n in graph.nodes)  # fmt: skip

    def uuid(self):
        return None  # never served from inductor's cache: this pass must see the graph


@pytest.fixture(scope="module")
def compiled(model, tmp_path_factory):
    """The model's step compiled once for this module (in each xdist worker that runs it)
    into a private directory, with inductor's last graph pass counting its GEMMs: → (the
    directory, the GEMMs counted, the compiles of that first engine). Every engine of this
    module loads that package."""
    where = tmp_path_factory.mktemp("steps")
    where.chmod(0o700)
    count = _CountGemms()
    with torch._inductor.config.patch(post_grad_custom_post_pass=count):
        engine = Engine(model, make("vm", 40), compile=True, compile_cache=where)
    return where, count.gemms, engine.runner.compiles, engine.runner.layered


def uneven(model):
    """The model with its last layer's down projection given a bias of zeros: the same
    logits, but layers that differ, so the step is compiled as the whole model's graph."""
    m = copy.deepcopy(model)
    old = m.model.layers[-1].mlp.down_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.zero_()
    m.model.layers[-1].mlp.down_proj = new
    return m


@pytest.fixture(scope="module")
def whole(model, tmp_path_factory):
    """The step as the whole model's graph (``uneven``): → (the model, the directory, the
    GEMMs counted)."""
    m = uneven(model)
    where = tmp_path_factory.mktemp("whole")
    where.chmod(0o700)
    count = _CountGemms()
    with torch._inductor.config.patch(post_grad_custom_post_pass=count):
        engine = Engine(m, make("vm", 40), compile=True, compile_cache=where)
    assert not engine.runner.layered and engine.runner.compiles == 1
    return m, where, count.gemms


@pytest.fixture
def steps(compiled):
    return compiled[0]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_projections_sharing_an_input_run_as_one_gemm(model, compiled, whole):
    """q, k and v become one GEMM, gate and up another (vmcache.engine.packed_linears and
    vmcache.engine.layered; without the GEMM kernel, inductor's concat-linear pass): 4 GEMMs a
    layer. Built from one layer (where the GEMM kernel builds), the graph is that layer's (the
    lm_head runs the packed GEMM outside it); as the whole model, every layer's and the
    lm_head's."""
    where, gemms, compiles, built_from_one = compiled
    assert compiles == 1
    assert built_from_one == cpu_gemm.available()[0]
    assert gemms == (4 if built_from_one else 4 * CFG.num_hidden_layers + 1)
    assert whole[2] == 4 * CFG.num_hidden_layers + 1
    reqs = requests([(9, 4), (3, 4)], seed=5)
    engine = Engine(model, make("vm", 40), compile=True, compile_cache=where)
    assert outputs(engine, reqs) == outputs(Engine(model, make("vm", 40)), reqs)


@pytest.mark.parametrize("kind,pages", [("vm", 40), ("paged", 8)])
def test_the_whole_graph_step_keeps_the_tokens(whole, kind, pages):
    """Where the layers differ, the whole model's graph: the same tokens as the eager step,
    nothing recompiled."""
    m, where, _ = whole
    reqs = requests(SHAPES, seed=3)
    want = outputs(Engine(m, make(kind, pages)), reqs)
    engine = Engine(m, make(kind, pages), compile=True, compile_cache=where)
    assert engine.runner.compiles == 0 and not engine.runner.layered
    assert outputs(engine, reqs) == want
    assert engine.runner.compiles == 0


def test_engines_on_one_model_share_one_package_whatever_their_cache(model, steps):
    """The package is the model's step, not the cache's (the cache's storage and each layer's
    place in it are inputs): engines over caches of other sizes and kinds load the same file,
    and none of them compiles."""
    first = Engine(model, make("vm", 40), compile=True, compile_cache=steps).runner
    assert first.package is not None and first.package.parent == steps
    for kind, pages in (("vm", 10), ("paged", 8), ("paged", 40)):
        runner = Engine(model, make(kind, pages), compile=True, compile_cache=steps).runner
        assert runner.package == first.package and runner.compiles == 0


@pytest.mark.parametrize("cap", [None, 16])
def test_steps_above_the_graph_size_run_the_eager_step(model, steps, cap):
    """Without a cap every step runs the graph, a 40-token prefill too (one oneDNN GEMM per
    projection at every size); with ``max_graph_tokens`` set, a step of more tokens runs the
    eager step and the rest the graph. The tokens stay the eager engine's and nothing
    recompiles."""
    reqs = requests([(40, 5), (3, 6), (12, 4)], seed=7)
    want = outputs(Engine(model, make("vm", 40)), reqs)
    engine = Engine(model, make("vm", 40), compile=True, compile_cache=steps)
    runner, warm = engine.runner, engine.runner.compiles
    assert runner.max_graph_tokens is None  # the default: no cap
    runner.max_graph_tokens = cap
    eager_sizes, eager_step = [], runner.eager.step

    def counted(slots, starts, tokens, **kw):
        eager_sizes.append(sum(len(t) for t in tokens))
        return eager_step(slots, starts, tokens, **kw)

    runner.eager.step = counted  # this runner's own eager runner, built for this test
    assert outputs(engine, reqs) == want
    if cap is None:
        assert eager_sizes == []  # the prefills went through the graph too
    else:
        assert eager_sizes and min(eager_sizes) > cap  # the prefill went eager, nothing else
        assert engine.stats.steps > len(eager_sizes)  # the decodes went through the graph
    assert runner.compiles == warm


def test_the_graph_size_is_checked_before_anything_compiles(model):
    kv = make("vm", 40)
    with pytest.raises(ValueError, match="max_graph_tokens must be at least 6"):
        CompiledRunner(model, kv, max_graph_tokens=5)
    with pytest.raises(TypeError, match="max_graph_tokens must be an int or None"):
        CompiledRunner(model, kv, max_graph_tokens=True)
    assert kv.stats().num_sequences == 0


def test_prefix_caching_and_swap_under_the_compiled_step(model, steps):
    shared = tuple(range(3, 60))  # 57 shared tokens: whole 32-token pages hit
    reqs = [Request(f"p{i}", shared + (i + 1, 2 * i + 5), SamplingParams(max_new_tokens=6))
            for i in range(5)]  # fmt: skip
    want = outputs(Engine(model, prefix_vm(40)), reqs)
    kv = prefix_vm(14)
    engine = Engine(model, kv, compile=True, compile_cache=steps, preemption="swap")
    got = outputs(engine, reqs)
    assert got == want
    assert engine.stats.prefix_hit_tokens > 0
    check_invariants(kv)


def test_drafts_run_the_eager_step_and_keep_the_tokens(model, steps):
    reqs = [Request("s", (1, 2, 3, 1, 2, 3, 1, 2, 3), SamplingParams(max_new_tokens=10))]
    want = outputs(Engine(model, make("vm", 40)), reqs)
    engine = Engine(
        model, make("vm", 40), compile=True, compile_cache=steps, speculative=NgramDrafter(k=3)
    )
    assert outputs(engine, reqs) == want


@pytest.mark.parametrize("q_lens", [(17, 1, 33, 1, 5), (3, 1, 8, 1, 2), (16, 1, 9, 1, 12)])
@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_step_attention_equals_the_batched_kernel_and_the_reference(kind, q_lens):
    """The operator on its own (eager): writes where the batch writes, attends as the eager
    step does, over awkward lengths and a mix of prefills and decodes (long prefills gathered
    beside the decodes through the CPU kernel; short ones through the kernel too, a query a
    token)."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                  num_q_heads=6)  # fmt: skip
    if kind == "vm":
        kv = VMKVCache(spec, 6, 96, page_size=4096, backend=strict_host(), own_backend=True,
                       pool_bytes=64 * 4096)  # fmt: skip
    else:
        kv = PagedKVCache(spec, num_blocks=64, block_size=16, max_seq_len=96, max_seqs=6)
    g = torch.Generator().manual_seed(1)
    seqs, written = [], []
    for history in [0, 15, 31, 64, 2]:
        s = kv.new_sequence()
        kv.grow(s, history)
        for layer in range(2):
            k, v = torch.randn(2, history, 2, 16, generator=g)
            if history:
                kv.write(layer, s, 0, k, v)
        written.append((k, v))  # layer 1's
        seqs.append(s)
    for s, q in zip(seqs, q_lens):
        kv.grow(s, q)
    n = sum(q_lens)
    q = torch.randn(n, 6, 16, generator=g)
    k, v = torch.randn(2, n, 2, 16, generator=g)
    layer = 1
    b = kv.batch(seqs, q_lens)
    read, _, _ = b.read_index(layer)
    lens = torch.tensor([b.q_lens, b.kv_lens])
    store = store_of(kv._flat_rows(0, 0))
    layout = layout_of(store, kv._flat_rows(layer, 0), kv._flat_rows(layer, 1))
    with torch.inference_mode():
        got = step_attention(q, k.reshape(n, -1), v.reshape(n, -1), store, layout,
                             b.write_index(layer), read, lens, 0.25)  # fmt: skip
        # decodes beside prefills: the decodes through the CPU kernel, in place (where it builds);
        # short prefills too, each token a query
        plan, kernel = step_op._LAST_PLAN[0][4], cpu_decode.serves(q, torch.float32)
        short = max(q_lens) <= step_op.SHORT_PREFILL
        assert isinstance(plan, step_op._Mixed) == (kernel and not short)
        assert isinstance(plan, cpu_decode_plan.DecodeRows) == (kernel and short)
        b.write(layer, k, v)  # the same K/V again, through the eager path
        want = kernels.attend(kv, layer, q, seqs, q_lens, scale=0.25, batch=b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    at = 0
    for (hk, hv), ql in zip(written, q_lens):  # against the plain reference, one by one
        keys = torch.cat([hk, k[at : at + ql]])
        values = torch.cat([hv, v[at : at + ql]])
        ref = dense_attention(q[at : at + ql], keys, values, scale=0.25)
        torch.testing.assert_close(got[at : at + ql], ref, rtol=1e-4, atol=1e-4)
        at += ql
    kv.close()


def test_what_it_cannot_compile_is_refused_with_the_reason(model):
    windows = KVSpec(2, 2, 16, torch.float32, layer_windows=(None, 8))
    assert "sliding-window" in unsupported(model, _Spec(windows))
    fp8 = KVSpec(2, 2, 16, torch.float32, kv_dtype=torch.float8_e4m3fn)
    assert "K/V" in unsupported(model, _Spec(fp8))
    assert unsupported(model, _Spec(SPEC)) is None
    quantized = KVSpec.from_hf_config(model.config, kv_dtype=torch.float8_e4m3fn)
    kv = VMKVCache(quantized, 4, 64, pool_bytes=64 << 10, page_size=4096)
    with pytest.raises(ValueError, match="compile=True cannot compile.*use compile=False"):
        Engine(model, kv, compile=True)
    assert kv.stats().num_sequences == 0 and kv.stats().physical_pages == 0  # nothing left


class _Spec:
    """What ``unsupported`` reads of a cache: its spec and whether rows lie per sequence."""

    def __init__(self, spec) -> None:
        self.spec = spec

    def _seq_rows(self, layer, kv):
        return torch.empty(0)


def test_the_server_flag_builds_the_compiled_engine(model, steps):
    from vmcache.engine.compiled import CompiledRunner
    from vmcache.server.cli import build_engine, parse_args

    args = parse_args(["--compile", "--compile-cache", str(steps), "--pool-mib", "1",
                       "--max-seqs", "4", "--max-seq-len", "64"])  # fmt: skip
    engine = build_engine(args, model)
    assert isinstance(engine.runner, CompiledRunner)
    out = engine.run([Request("a", (5, 6, 7), SamplingParams(max_new_tokens=4))])
    assert len(out["a"][0]) == 4
    assert not isinstance(build_engine(parse_args(["--no-compile"]), model).runner,
                          CompiledRunner)  # fmt: skip
    with pytest.raises(SystemExit):  # where to keep a compiled step, with nothing compiled
        parse_args(["--no-compile", "--compile-cache", str(steps)])
    with pytest.raises(SystemExit):
        parse_args(["--compile", "--no-compile"])


def test_the_server_compiles_by_default_where_it_can_and_says_so(model, steps, capsys):
    from vmcache.server.cli import build_engine, parse_args

    assert parse_args([]).compile == "auto"
    small = ["--compile-cache", str(steps), "--pool-mib", "1", "--max-seqs", "4",
             "--max-seq-len", "64"]  # fmt: skip
    engine = build_engine(parse_args(small), model)  # no flag: compiled, from the cache here
    assert isinstance(engine.runner, CompiledRunner) and engine.runner.compiles == 0
    assert engine.compile_choice.startswith(f"compiled: loaded from {steps}")
    assert "the compiled step: loaded from" in capsys.readouterr().err
    # where it cannot (INT8 K/V), the eager step, with the reason
    engine = build_engine(parse_args([*small, "--kv-dtype", "int8"]), model)
    assert not isinstance(engine.runner, CompiledRunner)
    assert engine.compile_choice.startswith("eager: the compiled step cannot run")
    assert "K/V" in engine.compile_choice
    with pytest.raises(ValueError, match="K/V"):  # --compile insists
        build_engine(parse_args([*small, "--kv-dtype", "int8", "--compile"]), model)
    with pytest.raises(ValueError, match="compile must be"):
        Engine(model, make("vm", 40), compile="yes")
