"""Where a run's time goes, read from a torch.profiler trace by the same rules for every
system (benchmarks/bench_vllm_profile.py for ours; vLLM's worker, benchmarks/vllm_anchor.py,
imports it in its own venv). Each part is the CPU time of the outermost events that match it
(an op inside a matching op is not counted twice):

    linear layers       every GEMM, wherever it runs (the lm_head's too): vLLM's oneDNN /
                        SGL linear ops; inductor's GEMM templates (with the epilogues fused
                        into them), oneDNN linear calls and vmcache::packed_linear in our
                        package (inductor's kernels record events only when built with
                        inductor's cpp.enable_kernel_profile)
    attention           the attention op, K/V written and read (vLLM's unified attention /
                        CPU attention ops; vmcache::step_attention)
    rest of the model   the scopes that run the model (MODEL_SCOPES: vLLM's forward and its
                        logits; our model call) less the two above: norms, rotary,
                        activations, residuals, the graph's glue
    sampling, outputs   the scopes that sample and hand tokens back (SAMPLE_SCOPES)
    everything else     the run's wall time less all of the above: the scheduler, building
                        each step's inputs (pages mapped, index tensors), the engine loop,
                        Python; vLLM's detokenizing

A scope is a torch.profiler record_function range: vLLM's model runner opens them under
VLLM_CUSTOM_SCOPES_FOR_PROFILING=1, our engine's stages always (vmcache.engine.engine)."""

from __future__ import annotations

import contextlib
import re

# (inductor's kernels are named "graph_<n>_" and the ops they fuse, which may be an attention
# op's inputs: of them only its GEMM templates, "graph_<n>_gemm_...", count, as linear layers)
GEMM = re.compile(r"^graph_\d+_gemm|^(?!graph_).*(onednn_mm|weight_packed_linear|linear|gemm|"
                  r"addmm|aten::mm$|aten::bmm$)", re.I)  # fmt: skip
ATTENTION = re.compile(r"^(?!graph_).*(attention|attn)", re.I)
MODEL_SCOPES = ("gpu_model_runner: forward", "gpu_model_runner: postprocess", "vmcache: model")
SAMPLE_SCOPES = ("gpu_model_runner: sample", "gpu_model_runner: bookkeep",
                 "vmcache: postprocess")  # fmt: skip
TOP = 15  # the names of most own time kept beside the parts, to check what each part holds
PARTS = ("linear layers", "attention", "rest of the model", "sampling, outputs",
         "everything else")  # fmt: skip


def trace(on: bool):
    """A torch.profiler trace of the CPU's ops when ``on``, else a context that records
    nothing (either way ``with trace(on) as prof``; ``prof`` is None when off)."""
    import torch  # (imported here: vLLM's worker loads this file before vLLM sets it up)

    if not on:
        return contextlib.nullcontext()
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def _outermost(events, match) -> list:
    """The events ``match`` accepts whose ancestors it does not."""
    out = []
    for e in events:
        if not match(e.name):
            continue
        p = e.cpu_parent
        while p is not None and not match(p.name):
            p = p.cpu_parent
        if p is None:
            out.append(e)
    return out


def _inside(e, ids: set[int]) -> bool:
    """Whether an event of ``ids`` (their ``id()``) holds ``e``."""
    p = e.cpu_parent
    while p is not None:
        if id(p) in ids:
            return True
        p = p.cpu_parent
    return False


def parts(events, wall_s: float) -> dict:
    """``events``: a profile's ``prof.events()`` (FunctionEvents, CPU times in µs);
    ``wall_s``: the profiled run's wall time → {part: seconds} over :data:`PARTS`, and the
    names the two op parts matched, with their calls (``"matched"``), and the :data:`TOP`
    names of most own time (``"top_own_s"``), so a reader can check what was counted."""
    events = list(events)
    attn = _outermost(events, lambda n: bool(ATTENTION.search(n)))
    # (a matrix product inside the attention op is the attention's)
    ids = {id(e) for e in attn}
    gemm = [e for e in _outermost(events, lambda n: bool(GEMM.search(n))) if not _inside(e, ids)]
    model = _outermost(events, lambda n: n in MODEL_SCOPES)
    sample = _outermost(events, lambda n: n in SAMPLE_SCOPES)
    in_model, in_sample = {id(e) for e in model}, {id(e) for e in sample}
    s = 1e-6
    g, a = sum(e.cpu_time_total for e in gemm) * s, sum(e.cpu_time_total for e in attn) * s
    inner = sum(e.cpu_time_total for e in gemm + attn if _inside(e, in_model)) * s
    rest = sum(e.cpu_time_total for e in model) * s - inner
    # (an op of the two parts inside a sampling scope is its part's, not counted twice)
    outer = sum(e.cpu_time_total for e in gemm + attn if _inside(e, in_sample)) * s
    samp = sum(e.cpu_time_total for e in sample) * s - outer
    out = {"linear layers": g, "attention": a, "rest of the model": rest,
           "sampling, outputs": samp}  # fmt: skip
    out["everything else"] = wall_s - sum(out.values())
    matched: dict[str, int] = {}
    for e in gemm + attn:
        matched[e.name] = matched.get(e.name, 0) + 1
    own: dict[str, float] = {}  # each name's own time (its children's not in it)
    for e in events:
        own[e.name] = own.get(e.name, 0.0) + e.self_cpu_time_total * s
    top = dict(sorted(own.items(), key=lambda kv: -kv[1])[:TOP])
    return {"parts_s": out, "wall_s": wall_s, "matched": matched, "top_own_s": top}
