"""benchmarks/step_parts.py on a real torch.profiler trace: a "model" scope holding linear
layers, an attention op (with a matrix product inside, which is the attention's) and other
ops, a "sampling" scope, and time outside every scope; each part is counted once and the
parts add up to the wall time."""

import sys
import time

import torch
from repo import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from step_parts import PARTS, parts, trace  # noqa: E402


def _step(x, w):
    with torch.profiler.record_function("vmcache: model"):
        h = torch.nn.functional.linear(x, w)
        with torch.profiler.record_function("graph_0_cpp_fused_cos_step_attention_2"):
            h = h * 0.5  # an inductor kernel named after the attention it feeds: not it
        with torch.profiler.record_function("my_attention"):  # an op named for attention
            a = torch.softmax(h @ h.T, -1) @ h  # (its matmuls are the attention's)
        with torch.profiler.record_function("graph_0_gemm_ms64n256k256_cpp_fused_add_3"):
            a = a + 1.0  # an inductor GEMM template: a linear layer
        h = torch.relu(a + h) * 2.0  # the rest of the model
        logits = torch.nn.functional.linear(h, w)
    with torch.profiler.record_function("vmcache: postprocess"):
        tok = logits.argmax(-1).tolist()
    time.sleep(0.02)  # outside every scope: "everything else"
    return tok


def test_each_part_is_counted_once_and_they_add_up_to_the_wall_time():
    x, w = torch.randn(64, 256), torch.randn(256, 256)
    with trace(False) as off:
        _step(x, w)
    assert off is None  # (the untraced run's context records nothing)
    with trace(True) as prof:
        t = time.perf_counter()
        for _ in range(3):
            _step(x, w)
        wall = time.perf_counter() - t
    got = parts(prof.events(), wall)
    p = got["parts_s"]
    assert list(p) == list(PARTS) and got["wall_s"] == wall
    assert abs(sum(p.values()) - wall) < 1e-9
    assert got["matched"] == {
        "aten::linear": 6,
        "my_attention": 3,  # outermost only
        "graph_0_gemm_ms64n256k256_cpp_fused_add_3": 3,
    }
    assert all(v > 0 for v in p.values()), p
    assert p["everything else"] >= 0.05  # the three sleeps, and nothing counted twice
    events = list(prof.events())
    run = sum(e.cpu_time_total for e in events if e.name == "vmcache: model") * 1e-6
    assert abs(p["linear layers"] + p["attention"] + p["rest of the model"] - run) < 1e-6
