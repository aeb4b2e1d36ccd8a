"""The Triton prefill (under TRITON_INTERPRET=1 here) on every cache against the plain
reference over what the test wrote: packed queries of awkward lengths (1, a block boundary of
64 crossed, several query blocks, a whole fresh prompt) over cached prefixes, GQA ratios 1–8,
head sizes 64 and 96, fp32 and bf16 (see GRID); and the dispatch's choices."""

import pytest
import torch
from kernel_cases import KINDS, SHAPES, TOL, WRITTEN, ancestors, fill, make

from vmcache import KVSpec, kernels
from vmcache.kernels import contiguous, triton_prefill
from vmcache.kernels.reference import dense_attention

LENS = [1, 15, 16, 17, 130, 257]
Q_LENS = [1, 15, 3, 17, 65, 130]  # 65: one row past a query block; 130: three blocks


def reference(cache, layer, q, seqs, q_lens):
    out, at = [], 0
    for s, n in zip(seqs, q_lens):
        out.append(dense_attention(q[at : at + n], *WRITTEN[id(cache), s, layer]))
        at += n
    return torch.cat(out)


# bf16 at GQA 1 and at GQA 4 with a padded head size (96): under the interpreter the dots run
# in fp32 whatever the dtype (triton_tiles.prepare), so bf16 adds its loads and casts, which do
# not depend on the group; GQA 8 (a tile of 8 query heads' rows) is covered in fp32
GRID = [(g, d, t) for g, d in SHAPES for t in (torch.float32, torch.bfloat16)
        if t == torch.float32 or g < 8]  # fmt: skip


@pytest.mark.parametrize("group,head_dim,dtype", GRID)
@pytest.mark.parametrize("kind", KINDS)
def test_triton_prefill_matches_the_reference(kind, group, head_dim, dtype):
    spec = KVSpec(2, 2, head_dim, dtype, num_q_heads=2 * group)
    cache = make(kind, spec)
    seqs = fill(cache, LENS)
    q = torch.randn(sum(Q_LENS), spec.q_heads, head_dim).to(dtype)
    out = kernels.prefill(cache, 1, q, seqs, Q_LENS, impl="triton")
    assert out.shape == q.shape and out.dtype == dtype
    want = reference(cache, 1, q, seqs, Q_LENS)
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    cache.close()


@pytest.mark.parametrize("kind", KINDS)
def test_triton_prefill_of_whole_prompts_equals_the_per_sequence_path(kind):
    """q_len = kv_len (fresh prompts, the engine's first chunk): every key is a query's own."""
    spec = KVSpec(1, 2, 64, torch.float32, num_q_heads=4)
    cache = make(kind, spec)
    lens = [3, 64, 100]
    seqs = fill(cache, lens)
    q = torch.randn(sum(lens), 4, 64)
    torch.testing.assert_close(
        kernels.prefill(cache, 0, q, seqs, lens, impl="triton"),
        kernels.prefill(cache, 0, q, seqs, lens),  # the CPU default: SDPA / gather
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip
    cache.close()


def test_the_launch_checks_its_arguments_and_sizes_its_grid():
    q = torch.zeros(10, 4, 64)
    k = v = torch.zeros(2, 32, 2, 64)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    starts = torch.tensor([0, 3, 10], dtype=torch.int32)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    out, ((kernel, grid, _, kw),) = triton_prefill.launches(
        q, k, v, slots, lens, starts, max_q=7, paged=False, block=1
    )
    assert out.shape == q.shape and grid == (2, 1, 4) and kw["G"] == 2
    with pytest.raises(ValueError, match="multiple of KV heads"):
        triton_prefill.launches(torch.zeros(10, 3, 64), k, v, slots, lens, starts, max_q=7,
                                paged=False, block=1)  # fmt: skip
    with pytest.raises(ValueError, match="window"):
        triton_prefill.launches(q, k, v, slots, lens, starts, max_q=7, paged=False, block=1,
                                window=0)  # fmt: skip
    with pytest.raises(TypeError, match="share a dtype"):
        triton_prefill.launches(q.double(), k, v, slots, lens, starts, max_q=7, paged=False,
                                block=1)  # fmt: skip


def test_prefill_dispatch_names_its_impls():
    spec = KVSpec(1, 2, 64, torch.float32, num_q_heads=4)
    cache = make("vm", spec)
    seqs = fill(cache, [4])
    q = torch.randn(2, 4, 64)
    assert contiguous.PREFILL_IMPLS == ("aten_fa2", "triton", "sdpa")
    with pytest.raises(ValueError, match="unknown contiguous prefill impl"):
        kernels.prefill(cache, 0, q, seqs, [2], impl="flash_attn")
    cache.close()


def masked_reference(q, k, v, keep):
    """Attention of q [n, N_Q, d] over k, v [L, N_KV, d] where ``keep`` [n, L] allows."""
    g = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.float() / q.shape[-1] ** 0.5, kf)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vf)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_prefill_reads_token_tree_masks(kind):
    """One call for a step that mixes trees (three chains; a lone root), a causal chunk and a
    decode row: each tree query sees the history and its ancestors only, like SDPA's path."""
    spec = KVSpec(2, 2, 64, torch.float32, num_q_heads=8)
    cache = make(kind, spec)
    trees = {1: [-1, 0, 1, 0, 3, 0, 5], 3: [-1]}  # sequence index -> parents
    lens, q_lens = [17, 40, 9, 30], [3, 7, 1, 1]
    seqs = fill(cache, lens)
    masks = [ancestors(trees[i]) if i in trees else None for i in range(4)]
    q = torch.randn(sum(q_lens), 8, 64)
    out = kernels.attend(cache, 1, q, seqs, q_lens, impl="triton", masks=masks)
    sdpa = kernels.attend(cache, 1, q, seqs, q_lens, masks=masks)  # the CPU path
    at = 0
    for i, (s, n, length) in enumerate(zip(seqs, q_lens, lens)):
        k, v = WRITTEN[id(cache), s, 1]
        keep = torch.ones(n, length, dtype=torch.bool)
        keep[:, length - n :] = masks[i] if masks[i] is not None else torch.ones(n, n).tril() > 0
        want = masked_reference(q[at : at + n], k, v, keep)
        torch.testing.assert_close(out[at : at + n], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sdpa[at : at + n], want, rtol=1e-4, atol=1e-5)
        at += n
    # a sibling's key changes nothing for the other chains' queries: chains do not mix
    k, v = WRITTEN[id(cache), seqs[1], 1]
    k2 = k.clone()
    k2[-1] += 100.0  # the last token of the third chain
    cache.write(1, seqs[1], 0, k2, v)
    again = kernels.attend(cache, 1, q, seqs, q_lens, impl="triton", masks=masks)
    rows = slice(3, 3 + 5)  # the tree's tokens 0-4: none has token 6 as an ancestor
    torch.testing.assert_close(again[rows], out[rows], rtol=0, atol=0)
    assert not torch.allclose(again[3 + 6], out[3 + 6])
    cache.close()


def test_tree_rows_are_32_bit_words_and_larger_trees_take_sdpa():
    from vmcache.kernels.common import packed_trees

    anc = ancestors([-1] + list(range(31)))  # one chain of 32: row 31 sees every token
    flags, rows = packed_trees([None, anc])
    assert flags == (False, True) and rows.dtype == torch.int32 and rows.shape == (32,)
    assert rows[0] == 1 and rows[31] == -1  # all 32 bits set (two's complement)
    with pytest.raises(ValueError, match="at most 32"):
        packed_trees([ancestors([-1] + list(range(32)))])


@pytest.mark.parametrize("kind", KINDS)
def test_head_dim_256_decodes_and_prefills_in_triton(kind):
    """Gemma's head_dim: the kernels take smaller tiles there (shared memory, registers)."""
    spec = KVSpec(1, 2, 256, torch.float32, num_q_heads=4)
    cache = make(kind, spec)
    lens, q_lens = [1, 40, 100], [1, 9, 33]
    seqs = fill(cache, lens)
    q = torch.randn(sum(q_lens), 4, 256)
    out = kernels.prefill(cache, 0, q, seqs, q_lens, impl="triton")
    torch.testing.assert_close(out, reference(cache, 0, q, seqs, q_lens), **TOL[torch.float32])
    qd = torch.randn(3, 4, 256)
    want = torch.stack([dense_attention(qd[i : i + 1], *WRITTEN[id(cache), s, 0])[0]
                        for i, s in enumerate(seqs)])  # fmt: skip
    torch.testing.assert_close(kernels.decode(cache, 0, qd, seqs, impl="triton"), want,
                               **TOL[torch.float32])  # fmt: skip
    cache.close()


def test_a_steps_tree_masks_are_packed_once_for_all_its_layers():
    from vmcache.kernels.common import TreeMasks, packed_trees

    masks = TreeMasks([None, ancestors([-1, 0, 0])])
    first = packed_trees(masks)
    assert packed_trees(masks) is first  # the same words, not packed again
    assert first[0] == (False, True) and first[1].tolist() == [1, 3, 5]
    assert packed_trees(list(masks))[1].tolist() == [1, 3, 5]  # a plain list: packed each call
