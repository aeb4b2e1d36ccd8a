"""The CPU decode kernel (vmcache.kernels.cpu_decode) against SDPA over gathered rows, over
awkward sizes (one key, GQA groups of 1 to 4, head dims not a power of two, scattered and
repeated rows; head dims of VW·NV that take the vector path, with lengths that leave rows past
the last block of VW, and sequences long enough to be split into parts), at both vector widths
(8, AVX2's; 16, AVX-512's: each built here whatever the machine's), and its refusals: nothing
is read out of bounds."""

import pytest
import torch
import torch.nn.functional as F

from vmcache.kernels.cpu_decode import KERNEL, available
from vmcache.kernels.cpu_decode_plan import DecodeRows, decode_rows

pytestmark = pytest.mark.skipif(not available()[0], reason=f"no kernel: {available()[1]}")

# the kernel at each vector width, whatever this machine's (None: the machine's, as shipped)
_WIDTHS = {vw: KERNEL.variant(f"-DVW={vw}") for vw in (8, 16)}


def _decode(q, store, layout, read, lens, scale, vw=None):
    plan = DecodeRows(read, lens, layout[0], q.shape[1], q.shape[2])
    if vw is not None:
        plan.fn = _WIDTHS[vw].fn
    return plan(q, store, layout, scale)


def _store(rows, width, pad=5):
    store = torch.randn(pad + 2 * rows * width)
    return store, (rows, width, pad, pad + rows * width)


def _reference(q, store, layout, read, lens, scale):
    rows, width, k_at, v_at = layout
    k_rows = store[k_at : k_at + rows * width].view(rows, width)
    v_rows = store[v_at : v_at + rows * width].view(rows, width)
    heads, dim = q.shape[1], q.shape[2]
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        k = k_rows[read[b, :n]].view(n, -1, dim).transpose(0, 1)
        v = v_rows[read[b, :n]].view(n, -1, dim).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b][:, None], k, v, scale=scale, enable_gqa=True)
        out.append(o[:, 0])
    assert heads % k.shape[0] == 0
    return torch.stack(out)


@pytest.mark.parametrize(
    "batch,heads,heads_kv,dim,span",
    [(1, 1, 1, 8, 1), (3, 9, 3, 64, 37), (2, 4, 4, 16, 5), (5, 8, 2, 80, 300),
     (4, 12, 3, 24, 129), (2, 6, 2, 128, 70), (3, 4, 1, 32, 33), (2, 6, 3, 48, 47),
     (1, 9, 3, 64, 1100), (2, 2, 2, 112, 17)],
)  # fmt: skip
@pytest.mark.parametrize("vw", [None, 8, 16])
def test_matches_sdpa_over_gathered_rows(batch, heads, heads_kv, dim, span, vw):
    g = torch.Generator().manual_seed(batch * 1000 + span)
    rows = 3 * span + 11
    store, layout = _store(rows, heads_kv * dim)
    read = torch.randint(0, rows, (batch, span), generator=g)
    lens = torch.randint(1, span + 1, (batch,), generator=g)
    lens[0] = span
    q = torch.randn(batch, heads, dim, generator=g)
    out = _decode(q, store, layout, read, lens, 0.37, vw)
    ref = _reference(q, store, layout, read, lens, 0.37)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_reads_only_each_sequences_length():
    """Rows past a sequence's length are never read: poisoning them changes nothing."""
    rows, span = 64, 16
    store, layout = _store(rows, 2 * 8)
    read = torch.arange(2 * span).view(2, span)
    lens = torch.tensor([5, 16])
    q = torch.randn(2, 4, 8)
    out = decode_rows(q, store, layout, read, lens, 0.5)
    poisoned = store.clone()
    k_rows = poisoned[layout[2] : layout[2] + rows * 16].view(rows, 16)
    k_rows[5:span] = float("nan")  # sequence 0's rows past its 5 tokens
    torch.testing.assert_close(decode_rows(q, poisoned, layout, read, lens, 0.5), out)


@pytest.mark.parametrize("dim", [8, 64, 128])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("vw", [None, 8, 16])
def test_vector_blocks_read_no_row_past_a_length(dim, threads, vw):
    """The blocks of VW and 32 rows stop at each sequence's length: NaN in every K and V row
    past it changes nothing, at lengths on and off a block's edge, one part or several."""
    g = torch.Generator().manual_seed(dim + threads)
    lens = torch.tensor([16, 17, 31, 33, 600])
    span, width = 640, 2 * dim
    rows = lens.numel() * span
    store, layout = _store(rows, width)
    read = torch.arange(rows).view(-1, span)
    q = torch.randn(lens.numel(), 4, dim, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _decode(q, store, layout, read, lens, 0.3, vw)
        poisoned = store.clone()
        for at in layout[2:]:
            kv = poisoned[at : at + rows * width].view(-1, span, width)
            for b, n in enumerate(lens.tolist()):
                kv[b, n:] = float("nan")
        again = _decode(q, poisoned, layout, read, lens, 0.3, vw)
    finally:
        torch.set_num_threads(before)
    assert not again.isnan().any()
    torch.testing.assert_close(again, out)
    torch.testing.assert_close(out, _reference(q, store, layout, read, lens, 0.3),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_refusals():
    store, layout = _store(10, 16)
    q = torch.randn(2, 4, 8)
    read = torch.zeros(2, 3, dtype=torch.long)
    lens = torch.tensor([1, 3])
    with pytest.raises(ValueError, match="rows in"):
        decode_rows(q, store, layout, read + 10, lens, 1.0)
    with pytest.raises(ValueError, match="rows in"):
        decode_rows(q, store, layout, read - 1, lens, 1.0)
    with pytest.raises(ValueError, match="kv_lens"):
        decode_rows(q, store, layout, read, torch.tensor([0, 3]), 1.0)
    with pytest.raises(ValueError, match="kv_lens"):
        decode_rows(q, store, layout, read, torch.tensor([1, 4]), 1.0)
    with pytest.raises(ValueError, match="end of store"):
        decode_rows(q, store[:-1], layout, read, lens, 1.0)
    with pytest.raises(ValueError, match="do not agree"):
        decode_rows(torch.randn(2, 3, 8), store, layout, read, lens, 1.0)
    with pytest.raises(ValueError, match="do not agree"):  # a row narrower than one head
        decode_rows(torch.randn(2, 4, 32), store, layout, read, lens, 1.0)
    with pytest.raises(ValueError, match="do not agree"):
        decode_rows(torch.randn(0, 4, 8), store, layout, read[:0], lens[:0], 1.0)
    with pytest.raises(TypeError, match="float32"):
        decode_rows(q.double(), store, layout, read, lens, 1.0)


def test_a_plan_with_write_stores_the_new_rows_before_reading():
    """The step's new K/V go to ``write``'s rows inside the kernel call (what index_copy_ did
    before it), every layer with its own store place; the output reads them."""
    g = torch.Generator().manual_seed(3)
    rows, width, heads, dim = 40, 2 * 16, 6, 16
    store, layout = _store(rows, width)
    read = torch.randint(0, rows, (3, 9), generator=g)
    lens = torch.tensor([9, 4, 7])
    write = read[torch.arange(3), lens - 1].contiguous()  # each sequence's last position
    q = torch.randn(3, heads, dim, generator=g)
    k, v = torch.randn(3, width, generator=g), torch.randn(3, width, generator=g)
    want = store.clone()
    k_at, v_at = layout[2], layout[3]
    want[k_at : k_at + rows * width].view(rows, width).index_copy_(0, write, k)
    want[v_at : v_at + rows * width].view(rows, width).index_copy_(0, write, v)
    plan = DecodeRows(read, lens, rows, heads, dim, write)
    out = plan(q, store, layout, 0.25, k, v)
    assert torch.equal(store, want)  # those rows and no other
    torch.testing.assert_close(out, _reference(q, want, layout, read, lens, 0.25),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="write"):  # out of the layer's rows
        DecodeRows(read, lens, rows, heads, dim, write + rows)
    with pytest.raises(ValueError, match="a plan with write"):  # this plan has none
        DecodeRows(read, lens, rows, heads, dim)(q, store, layout, 0.25, k, v)
    with pytest.raises(ValueError, match="a plan with write"):
        plan(q, store, layout, 0.25, k[:, :-1], v)
    with pytest.raises(ValueError, match="a plan with write"):
        plan(q, store, layout, 0.25, k, None)
    assert torch.equal(store, want)  # refused calls wrote nothing
