"""The varlen metadata aten FA2 gets on the GPU (sorted order, cu_seq_q, cu_seq_k = slot·L_row,
seqused_k), checked on the CPU by a plain varlen attention that reads only what FA2 would:
rows [cu_k[i], cu_k[i] + used_k[i]) of the flat layer view."""

import pytest
import torch
from caches import strict_host

from vmcache import KVSpec, VMKVCache, kernels
from vmcache.kernels.contiguous import flat_rows
from vmcache.kernels.plan import plan
from vmcache.kernels.reference import dense_attention
from vmcache.sequences.invariants import check_invariants


def varlen_reference(q, k_flat, v_flat, p):
    """What FA2's varlen kernel computes from the plan: q sorted by p.perm, output unsorted."""
    qs = q.index_select(0, p.perm)
    out = torch.empty_like(qs)
    cu_q, cu_k, used = p.cu_q.tolist(), p.cu_k.tolist(), p.used_k.tolist()
    for i in range(len(used)):
        k = k_flat[cu_k[i] : cu_k[i] + used[i]]
        v = v_flat[cu_k[i] : cu_k[i] + used[i]]
        out[cu_q[i] : cu_q[i + 1]] = dense_attention(qs[cu_q[i] : cu_q[i + 1]], k, v)
    return out.index_select(0, p.inv)


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
def test_varlen_plan_addresses_each_sequence(layout):
    spec = KVSpec(3, 2, 24, torch.float32, num_q_heads=4)  # 96 B rows: lcm padding needed
    c = VMKVCache(spec, 6, 300, page_size=4096, layout=layout, backend=strict_host(),
                  own_backend=True)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (40, 7, 129, 1, 64):
        s = c.new_sequence()
        c.grow(s, n)
        for layer in range(3):
            c.write(layer, s, 0, *(torch.randn(n, 2, 24, generator=g) for _ in range(2)))
        seqs.append(s)
    seqs = [seqs[i] for i in (3, 0, 4, 1, 2)]  # not in slot order
    q_lens = [1, 5, 64, 7, 2]
    q = torch.randn(sum(q_lens), 4, 24, generator=g)
    p = plan(c, seqs, q_lens, varlen=True)
    l_row = c.views.layer_row_tokens(0)
    for layer in range(3):
        got = varlen_reference(q, flat_rows(c.views.k_cache(layer), l_row),
                               flat_rows(c.views.v_cache(layer), l_row), p)  # fmt: skip
        start = 0
        for s, ql in zip(seqs, q_lens):
            want = dense_attention(q[start : start + ql], *c.kv(layer, s))
            torch.testing.assert_close(got[start : start + ql], want, rtol=1e-5, atol=1e-6)
            start += ql
    assert p.max_q == 64 and p.max_kv == 129 and c.stats().plans_built == 1
    assert plan(c, seqs, q_lens, varlen=True) is p  # every layer reuses it
    assert p.slots.dtype == torch.int32 and p.slots.untyped_storage().data_ptr() == (
        p.cu_k.untyped_storage().data_ptr()
    )  # one buffer, one upload
    c.close()


@pytest.mark.parametrize("kind", ["vm", "vm_token_major", "paged"])
def test_a_decode_step_uploads_once_and_never_synchronises(kind):
    """The engine's decode step (grow every sequence, then per layer write and attend): one
    plan upload per step, whatever the layer count; the cache waits for the device only to
    unmap pages (here: one copy-on-write split, one sync for the whole operation)."""
    import caches

    spec = KVSpec(4, 2, 16, torch.float32, num_q_heads=4)
    size = {"blocks": 64} if kind == "paged" else {"pages": 256}
    c = caches.FACTORIES[kind](spec=spec, **size)
    seqs = [c.new_sequence() for _ in range(3)]
    for i, s in enumerate(seqs):
        c.grow(s, 10 + 7 * i)
    kv = torch.ones(1, 2, 16)
    q = torch.randn(3, 4, 16)
    be = getattr(c, "_backend", None)

    def step():
        for s in seqs:
            c.grow(s, 1)
        for layer in range(4):
            for s in seqs:
                c.write(layer, s, c.seq_len(s) - 1, kv, kv)
            kernels.decode(c, layer, q, seqs, impl="triton")

    for _ in range(3):
        plans, syncs = c.stats().plans_built, getattr(be, "sync_calls", 0)
        step()
        assert c.stats().plans_built - plans == 1
        assert getattr(be, "sync_calls", 0) - syncs == 0
    (kid,) = c.fork(seqs[0], 1)  # seqs[0]'s tail page is now shared
    syncs = getattr(be, "sync_calls", 0)
    c.grow(seqs[0], 1)  # splits the shared tail page in every table: one sync
    if be is not None:
        assert be.sync_calls - syncs == 1
    check_invariants(c)
