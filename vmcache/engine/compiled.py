"""The engine step compiled (``Engine(model, cache, compile=True)``): the model's own forward
compiled by inductor, every layer's K/V written into and read from the cache inside the
compiled graph through one operator (:func:`~vmcache.kernels.step_op.step_attention`).

What makes the graph reusable step after step is that the cache never moves: a VMKVCache
layer's K and V are one flat tensor of rows over a virtual range reserved once (pages are
mapped under it as sequences grow; PagedKVCache: its block pool), so every step hands the
graph the same storage, and only the step's small index tensors change:

    per step, on the host (once)          per layer, inside the graph
    ids, positions  [1, N]            ─►  the model's embedding, norms, projections, rotary
    store [E], layout int64 [L, 4]    ─►  step_attention on layer l's rows (layout[l]):
    write  int64 [N]                       K/V stored, history gathered,
    read   int64 [B, S]                    causal SDPA per sequence
    lens   int64 [2, B] (q, kv)       ─►  (its output [N, N_Q, d_h] back into the model)
    keep   int64 [B]                  ─►  logits of each sequence's last token only

Sizes are symbolic, so one graph serves every step: the token count N is at least 2 (a
lone decode runs as two copies of itself, one row of logits kept: a size of 1 would be
specialized into a second graph). ``warm_up`` runs it on scratch sequences before the first
request (one prefill, one decode, two sequences at once) and checks the compiled logits
against the eager step's there; :attr:`CompiledRunner.compiles` counts the graphs this
runner built, so a caller can see that serving compiled nothing more.

On the CPU the step is exported (``torch.export``) and compiled ahead of time into an
AOTInductor package (:mod:`vmcache.engine.packaged`), kept in ``compile_cache`` when one is
given: a later engine on the same model, in this process or another, over any cache, loads it in
seconds instead of compiling again. Where a model's decoder layers are alike (every model the
CPU GEMM serves so far), the package is one layer's code with its weights as inputs, run for
each layer (:mod:`vmcache.engine.layered`: seconds to build, not minutes); otherwise the whole
model's graph, as follows. Before inductor compiles it, the exported step's
float32 linear layers go onto vmcache's CPU GEMM (:mod:`vmcache.engine.packed_linears`,
:mod:`vmcache.kernels.cpu_gemm`): each weight packed once into panels, and the projections that
share an input (q, k and v; gate and up) stacked into one GEMM each, as vLLM's merged linear
layers are: 4 GEMMs a layer instead of 7, the same products. At a decode's few rows that kernel
is faster than oneDNN's matmul (vLLM's CPU GEMM, and inductor's; `make bench-gemm`), at a
prefill's a few per cent slower. inductor *freezes* the packed weights into the package as
constants; the package's wrapper, which calls its kernels, is C++ (the GEMM and attention
operators are called through the dispatcher). Where the C kernel cannot be built, every GEMM is
oneDNN's matmul on weights inductor packs (:data:`CPU_SETTINGS`: no kernel timing at compile
time). One graph serves decodes and prefills alike. The packed copies double the memory of the
linear weights, and the compiled step keeps computing with the weights it was built from (a
changed model is another package). On a GPU TorchDynamo compiles the step in the process, with
CUDA graphs.

The settings this needs are set for the length of each call only; nothing of the user's
model changes.
What it cannot compile it refuses at construction with the reason (``ValueError``):
sliding-window layers, FP8 / INT8 K/V, soft-capped attention; steps that verify drafts or
token trees, and steps of more than ``max_graph_tokens`` tokens where a cap is set (on a GPU
:data:`CUDA_MAX_GRAPH_TOKENS` unless given), run the eager step
(:class:`~vmcache.engine.runner.ModelRunner`) instead.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from vmcache.engine import layered, packaged
from vmcache.engine.runner import ModelRunner
from vmcache.hf.attention import no_mask
from vmcache.kernels.step_op import default_scale, step_attention
from vmcache.sequences.batch import layout_of, store_of

COMPILED_ATTN_NAME = "vmcache_compiled_step"
STEP_KWARG = "vmcache_step"  # the model-forward keyword the step's tensors travel under


def compiled_step_attention(module, query, key, value, attention_mask, dropout=0.0,
                            scaling=None, **kwargs):  # fmt: skip
    """transformers attention function of the compiled step: query ``[1, N_Q, N, d_h]``,
    key / value ``[1, N_KV, N, d_h]`` (the step's new tokens, rotary applied) →
    ``[1, N, N_Q, d_h]``, through ``step_attention`` on ``module.layer_idx``'s rows."""
    step = kwargs[STEP_KWARG]
    n = key.shape[2]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1).reshape(n, -1)
    v = value[0].transpose(0, 1).reshape(n, -1)
    scale = default_scale(query.shape[-1]) if scaling is None else float(scaling)
    out = step_attention(q, k, v, step["store"], step["layout"][module.layer_idx],
                         step["write"], step["read"], step["lens"], scale)  # fmt: skip
    return out[None], None


def register() -> None:
    """Make :data:`COMPILED_ATTN_NAME` available to transformers (idempotent)."""
    AttentionInterface.register(COMPILED_ATTN_NAME, compiled_step_attention)
    AttentionMaskInterface.register(COMPILED_ATTN_NAME, no_mask)


register()


def unsupported(model, kv) -> str | None:
    """Why the compiled step cannot run ``model`` over ``kv`` (None: it can)."""
    spec = kv.spec
    if any(w is not None for w in spec.layer_windows or ()):
        return "sliding-window layers (the compiled step reads full histories only)"
    if spec.quantized:
        return f"{spec.storage_dtype} K/V (the compiled step stores unquantized K/V only)"
    cfg = model.config.get_text_config()
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "soft-capped attention logits (SDPA has no soft-capping)"
    if any(getattr(layer.self_attn, "layer_idx", None) is None for layer in model.model.layers):
        return "attention modules without a layer_idx"
    return None


def toolchain_missing(device: torch.device) -> str | None:
    """Why inductor cannot build a step on ``device`` here (None: it can): a C++ compiler on
    the CPU, triton on a GPU."""
    if device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as e:  # noqa: BLE001 - inductor's own check, whatever it raises
            return f"no C++ compiler for inductor ({type(e).__name__}: {str(e)[:200]})"
        return None
    import importlib.util

    return None if importlib.util.find_spec("triton") else "triton is not installed"


def make_runner(model, kv, compile, compile_cache=None):
    """The engine's step runner for ``compile`` (True, False or ``"auto"``) → ``(runner,
    choice)``, ``choice`` saying which step runs and why. ``"auto"`` compiles where the model,
    the cache and the toolchain allow (:func:`unsupported`, :func:`toolchain_missing`, or a
    compile that fails) and runs the eager step otherwise; True refuses instead
    (``ValueError`` with the reason)."""
    if not (isinstance(compile, bool) or compile == "auto"):
        raise ValueError(f'compile must be True, False or "auto", got {compile!r}')
    if compile_cache is not None and compile is False:
        raise ValueError("compile_cache is where a compiled step is kept; pass compile=True or "
                         '"auto" with it')  # fmt: skip
    if compile is False:
        return ModelRunner(model, kv), "eager (compile=False)"
    if compile == "auto":
        eager = ModelRunner(model, kv)  # its device, and the step where none compiles
        why = unsupported(model, kv) or toolchain_missing(eager.device)
        if why is not None:
            return eager, f"eager: the compiled step cannot run {why}"
        try:
            runner = CompiledRunner(model, kv, compile_cache=compile_cache)
        except ValueError as e:
            return eager, f"eager: {e}"
    else:
        runner = CompiledRunner(model, kv, compile_cache=compile_cache)
    kept = runner.package is not None and compile_cache is not None
    if runner.compiles or runner.device.type != "cpu":
        how = f"built{f' into {runner.package.parent}' if kept else ''}"
    else:
        how = f"loaded from {runner.package.parent}"
    return runner, f"compiled: {how} in {runner.startup_s:.1f} s"


# The CPU step's inductor settings. Frozen weights; kernels that read the thread count when
# they run. Where vmcache's GEMM builds, the graph inductor gets has no linear layers left
# (packed_linears); where it does not, each linear layer's weight is packed for oneDNN's matmul
# (vLLM's CPU build calls the same library, `_C::onednn_mm`) and projections sharing an input
# are concatenated. No GEMM timing (max_autotune): inductor's timing of its C++ GEMM template
# against oneDNN, one GEMM alone with its weights in cache, chose the template at a decode's
# size, and in the whole step, its 425 MB of weights streamed from memory, that choice lost on
# an Intel Xeon (uniform workload, 2 cores: 4.78 s against 4.08 s, 2026-12-05) while it had won
# on an AMD EPYC (a 16-sequence decode step 77.8 against 86.4 ms, 2026-12-04).
CPU_SETTINGS = {"freezing": True, "cpp.enable_concat_linear": True, "cpp.dynamic_threads": True}
# On a GPU CUDA graphs are recorded once per step size: steps past this many tokens (prefills,
# bound by arithmetic) run eagerly, as vLLM runs batches larger than its CUDA graphs
CUDA_MAX_GRAPH_TOKENS = 256
WARM_UP_TOKENS = 6  # the warm-up's largest step (CompiledRunner.warm_up): one decode + 5


def _inductor_cuda(gm, example_inputs):
    """inductor with CUDA graphs (the GPU's step, through TorchDynamo). One function for every
    runner: TorchDynamo keeps a graph for the backend that built it, so runners on the same
    model share the graph."""
    from torch._inductor.compile_fx import compile_fx

    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        return compile_fx(gm, example_inputs)


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class _Step(torch.nn.Module):
    """The step as a module, for ``torch.export``: the model (its weights, to be frozen) and
    the runner's forward over the step's inputs."""

    def __init__(self, runner: CompiledRunner) -> None:
        super().__init__()
        self.model = runner.model
        self._forward = runner._forward

    def forward(self, ids, pos, keep, store, layout, write, read, lens):
        return self._forward(ids, pos, keep, store, layout, write, read, lens)


class CompiledRunner:
    """``step(slots, starts, tokens)`` → next-token logits ``[len(slots), vocab]`` (fp32), as
    :class:`~vmcache.engine.runner.ModelRunner`, through the compiled graph; construction
    compiles (:meth:`warm_up`) and raises ``ValueError`` (with the reason) where the model,
    the cache or the compiler cannot. ``startup_s``: how long that took. ``compile_cache``
    (CPU): the directory of packages to load the step from or compile it into
    (:class:`~vmcache.engine.packaged.PackageDir`); None: a temporary one of this runner's."""

    def __init__(self, model, kv, max_graph_tokens: int | None = None,
                 compile_cache: str | os.PathLike | None = None) -> None:  # fmt: skip
        if max_graph_tokens is not None:
            if isinstance(max_graph_tokens, bool) or not isinstance(max_graph_tokens, int):
                raise TypeError("max_graph_tokens must be an int or None")
            if max_graph_tokens < WARM_UP_TOKENS:  # the warm-up's steps must run the graph
                raise ValueError(f"max_graph_tokens must be at least {WARM_UP_TOKENS}, got "
                                 f"{max_graph_tokens}")  # fmt: skip
        self.eager = ModelRunner(model, kv)  # drafts, trees, large steps, warm-up's reference
        why = unsupported(model, kv)
        if why is not None:
            raise ValueError(f"compile=True cannot compile this model's step: {why}; "
                             "use compile=False")  # fmt: skip
        self.model, self.kv, self.device = model, kv, self.eager.device
        # larger steps run the eager step; None: none on the CPU, CUDA_MAX_GRAPH_TOKENS on a GPU
        if max_graph_tokens is None and self.device.type == "cuda":
            max_graph_tokens = CUDA_MAX_GRAPH_TOKENS
        self.max_graph_tokens = max_graph_tokens
        # the cache's storage (every layer's rows lie in it) and each layer's place there
        self.store = store_of(kv._flat_rows(0, 0))
        per_layer = [layout_of(self.store, kv._flat_rows(i, 0), kv._flat_rows(i, 1))
                     for i in range(kv.spec.num_layers)]  # fmt: skip
        self.layout = torch.stack(per_layer)  # int64 [L, 4]
        self.compiles = 0  # graphs built for this runner (CPU: a package; ≤ 1)
        self.package: Path | None = None  # CPU: the package the step runs (compile_cache)
        t = time.perf_counter()
        try:
            if self.device.type == "cpu":
                self._graph = self._packaged(compile_cache)
            else:  # TorchDynamo, at each call (CUDA graphs): _run_dynamo
                self._graph = torch.compile(self._forward, backend=_inductor_cuda,
                                            dynamic=True, fullgraph=True)  # fmt: skip
            self.warm_up()
        except ValueError:
            raise
        except Exception as e:  # dynamo / inductor: the reason, and the way out
            raise ValueError(f"compile=True could not compile this model's step "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:300]}); "
                             "use compile=False") from e  # fmt: skip
        self.startup_s = time.perf_counter() - t

    @property
    def layered(self) -> bool:
        """Whether the step was built from one layer (:mod:`vmcache.engine.layered`)."""
        return isinstance(getattr(self, "_graph", None), layered.LayeredStep)

    def _forward(self, ids, pos, keep, store, layout, write, read, lens):
        """The step's inputs (:func:`~vmcache.engine.packaged.step_dims`) → logits of each
        sequence's last token ``[B, vocab]`` fp32, through the model's own forward."""
        step = {"store": store, "layout": layout, "write": write, "read": read, "lens": lens}
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep,
                         **{STEP_KWARG: step})  # fmt: skip
        return out.logits[0].float()

    def _packaged(self, compile_cache):
        """The CPU step as an AOTInductor package (:mod:`vmcache.engine.packaged`): loaded from
        ``compile_cache`` when it holds this step's, else compiled (into it; None: into a
        directory of this runner's, removed with it)."""
        if compile_cache is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="vmcache-step-")
            compile_cache = self._scratch.name
        where = packaged.PackageDir(compile_cache)
        example = packaged.example_inputs(self.store, self.layout)
        plan = None
        if layered.unsupported(self.model) is None:  # one layer compiled, run for each
            try:
                with self._settings():
                    plan = layered.Plan(self.model, STEP_KWARG, example)
            except Exception:  # noqa: BLE001 - whatever the model's forward raises there
                plan = None  # (what the model hands its layers, or its trace: the whole graph)
        if plan is not None:
            settings = {**layered.SETTINGS, "layered": plan.key()}  # (the key's only)
            key = packaged.package_key(self.model, self.store.dtype, settings, weights=False)
            build = partial(plan.build, self.model, layered.SETTINGS)
        else:
            settings = dict(CPU_SETTINGS)
            key = packaged.package_key(self.model, self.store.dtype, settings)
            build = partial(packaged.build, _Step(self), example, settings)
        self.package = where.lookup(key)
        if self.package is None:
            with torch.inference_mode(), self._settings():
                self.package = where.save(key, build)
            self.compiles = 1
        if plan is not None:
            return plan.step(self.model, packaged.load(self.package),
                             partial(self.eager._attention, COMPILED_ATTN_NAME),
                             where.root)  # fmt: skip
        return packaged.load(self.package)

    @contextlib.contextmanager
    def _settings(self):
        """For one trace (the CPU's export; each of TorchDynamo's calls on a GPU): no duck
        sizing (sizes equal by chance must not become one symbol, or a later step recompiles),
        the model's float constants (norm epsilons, rotary and attention scales) as constants
        (traced as symbols, inductor cannot keep them and TorchDynamo starts the whole trace
        again), and the compiled attention on the model's configs."""
        import torch.fx.experimental._config as fx_config

        with (
            torch._dynamo.config.patch(specialize_float=True),
            fx_config.patch(use_duck_shape=False),
            self.eager._attention(COMPILED_ATTN_NAME),
        ):
            yield

    @torch.inference_mode()
    def step(self, slots: list[int], starts: list[int], tokens: list[list[int]],
             rows: list[int] | None = None, trees: list | None = None) -> torch.Tensor:  # fmt: skip
        """As :meth:`ModelRunner.step`; drafts (``rows``), token trees and steps of more
        than ``max_graph_tokens`` tokens (where it is set) run eagerly."""
        q_lens = [len(t) for t in tokens]
        cap = self.max_graph_tokens
        if rows is not None or trees is not None or (cap is not None and sum(q_lens) > cap):
            return self.eager.step(slots, starts, tokens, rows=rows, trees=trees)
        cache = self.eager.cache
        cache.begin(slots, starts, q_lens)  # checked, copied on write, indexed once
        b = cache.batch
        read, _, _ = b.read_index(0)
        write, lens = b.write_index(0), [list(b.q_lens), list(b.kv_lens)]
        flat = [t for ts in tokens for t in ts]
        pos = [p for s, q in zip(starts, q_lens) for p in range(s, s + q)]
        one = len(flat) == 1  # a lone decode runs as two copies of itself (see the module)
        if one:
            read, write = read.repeat(2, 1), write.repeat(2)
            lens, flat, pos, q_lens = [[1, 1], lens[1] * 2], flat * 2, pos * 2, [1, 1]
        dev = self.device
        args = (torch.tensor(flat, device=dev)[None], torch.tensor(pos, device=dev)[None],
                (torch.tensor(q_lens).cumsum(0) - 1).to(dev), self.store, self.layout, write,
                read, torch.tensor(lens))  # fmt: skip
        with torch.profiler.record_function("vmcache: model"):  # (a profiler's scope)
            out = self._graph(*args) if self.device.type == "cpu" else self._run_dynamo(args)
        return out[:1] if one else out

    def _run_dynamo(self, args) -> torch.Tensor:
        _, _, keep, _, _, write, read, lens = args
        # no size-1 specialization of the batch's sizes (the token count is ≥ 2 already)
        for t, dims in ((keep, (0,)), (write, (0,)), (read, (0, 1)), (lens, (1,))):
            for d in dims:
                torch._dynamo.decorators.mark_unbacked(t, d)
        before = _graphs()
        with self._settings():
            out = self._graph(*args)
        self.compiles += _graphs() - before
        return out

    def warm_up(self) -> None:
        """Compile the step's graph on scratch sequences (freed after; nothing else in the
        cache is touched), checking the compiled logits against the eager step's."""
        kv = self.kv
        if kv.capacity.free_slots < 1:
            raise ValueError("compile=True warms up on a free sequence slot; the cache has none")
        two = kv.capacity.free_slots >= 2
        a = kv.new_sequence()
        scratch = [a]
        try:
            kv.grow(a, 3)
            self._check([a], [0], [[1, 2, 3]])  # one prefill
            kv.grow(a, 1)
            self._check([a], [3], [[4]])  # one decode
            if two:
                b = kv.new_sequence()
                scratch.append(b)
                kv.grow(b, 5)
                kv.grow(a, 1)
                self._check([a, b], [4, 0], [[5], [6, 7, 8, 9, 10]])  # several sequences
        finally:
            for s in scratch:
                kv.free(s)

    def _check(self, slots, starts, tokens) -> None:
        got = self.step(slots, starts, tokens)
        want = self.eager.step(slots, starts, tokens)  # writes the same K/V again
        err = float((got - want).abs().max())
        tol = 1e-3 * max(1.0, float(want.abs().max()))
        if not err <= tol:
            raise ValueError(f"compile=True: the compiled step's logits differ from the "
                             f"eager step's by {err:.3g} (tolerance {tol:.3g}); use "
                             "compile=False")  # fmt: skip
