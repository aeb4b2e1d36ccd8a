"""A CUDA graph captured once over the virtual cache's addresses stays valid while sequences
grow: their ranges never move, so the pages mapped after the capture are read by each replay
(what a paged cache gets only by capturing its block table as a graph input, and what
CUDA-graph engines size their pools around). Skipped cleanly without a GPU and driver."""

import pytest
import torch

from vmcache import KVSpec, VMKVCache
from vmcache.kernels import triton_decode
from vmcache.kernels.reference import dense_attention

pytestmark = pytest.mark.gpu

MAX_LEN = 4096
START = [1, 500, 1024, 2000]  # tokens before the capture
GROWS = [1, 600, 1, 1100]  # then per replay, every sequence (crossing 2 MiB page edges)


def test_a_graph_captured_once_replays_over_pages_mapped_after_the_capture():
    spec = KVSpec(1, 8, 128, torch.bfloat16, num_q_heads=32)
    g = torch.Generator(device="cuda").manual_seed(0)
    with VMKVCache(spec, len(START), MAX_LEN, device="cuda") as c:
        seqs = [c.new_sequence() for _ in START]
        written = {s: ([], []) for s in seqs}  # the oracle: what each sequence holds

        def append(s, start, n):
            c.grow(s, n)
            k, v = (torch.randn(n, 8, 128, device="cuda", generator=g).to(spec.dtype)
                    for _ in range(2))  # fmt: skip
            c.write(0, s, start, k, v)
            written[s][0].append(k)
            written[s][1].append(v)

        for s, n in zip(seqs, START):
            append(s, 0, n)
        # the graph's inputs: static tensors, refilled in place before each replay
        q = torch.randn(len(seqs), 32, 128, device="cuda", generator=g).to(spec.dtype)
        slots = torch.tensor(seqs, dtype=torch.int32, device="cuda")  # row s: sequence s
        lens = torch.tensor(START, dtype=torch.int32, device="cuda")
        k_view, v_view = c.views.k_cache(0), c.views.v_cache(0)

        def step():  # no host read: the grid is sized by MAX_LEN, lengths read on the device
            return triton_decode.decode(q, k_view, v_view, slots, lens, max_len=MAX_LEN,
                                        paged=False, block=1)  # fmt: skip

        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        pages_at_capture = c.stats().physical_pages
        lengths = list(START)
        for n in GROWS:
            for i, s in enumerate(seqs):
                append(s, lengths[i], n)
                lengths[i] += n
            lens.copy_(torch.tensor(lengths, dtype=torch.int32))
            q.copy_(torch.randn(q.shape, device="cuda", generator=g).to(spec.dtype))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, step()), f"replay differs from eager at lengths {lengths}"
            for i, s in enumerate(seqs):  # and both read the rows written after the capture
                k, v = (torch.cat(written[s][j]).float().cpu() for j in (0, 1))
                ref = dense_attention(q[i : i + 1].float().cpu(), k, v)[0]
                torch.testing.assert_close(out[i].float().cpu(), ref, rtol=8e-3, atol=8e-3)
        assert c.stats().physical_pages > pages_at_capture  # pages were mapped after it
        assert c.views.k_cache(0).data_ptr() == k_view.data_ptr()  # the range never moved
