"""``torch.ops.vmcache.step_attention``: one layer of a packed engine step (write the new
K/V, attend over every sequence's history) as one operator that a compiled graph calls
without looking inside (vLLM's ``unified_attention`` is the same kind of boundary).

Everything it touches comes in as tensors, so a graph that calls it never holds a Python
object of the cache: the cache's whole storage as one flat tensor (``store``: its address
does not move while sequences grow; one argument for every layer, as a compiler can update
a mutated input in place only where no other mutated argument aliases it), where the
layer's K and V rows lie in it (``layout``, host), and the step's indices, built once a
step on the host (:meth:`~vmcache.sequences.batch.StepBatch.write_index`, ``read_index``):

    q      [N, N_Q, d_h]  packed queries, batch order (sequence b's q_len_b rows in a run)
    k, v   [N, R]         the same tokens' K/V as stored rows (R = N_KV · d_h)
    store  [E]            the storage; layout int64 [4]: rows, R, K's and V's offsets
    write  int64 [N]      row of k_rows / v_rows each token goes to
    read   int64 [B, S]   rows of sequence b's positions 0 … S−1 (past its length: repeats)
    lens   int64 [2, B]   host: q_len_b and kv_len_b (kv_len counts the new tokens)

        k_rows.index_copy_(0, write, k)            the step's K/V stored
        K = k_rows[read]  [B, S, N_KV, d_h]        every history, one gather
        queries grouped as the eager step does     (kernels.batched: decodes in one SDPA
        (plan_groups), causal per sequence          call, prefills padded or one each)

    a step of decodes only, float32 on the CPU: no gather, no index_copy_; kernels.cpu_decode
    stores the new rows and reads each sequence's rows in place, where ``read`` says (both
    caches; VMKVCache's are consecutive); prefills of at most SHORT_PREFILL tokens beside them
    go the same way, a query each; longer prefills are gathered for SDPA (the decodes beside
    them still through the kernel)

Full-attention layers and unquantized K/V only (the compiled step checks this once).
"""

from __future__ import annotations

import math
import weakref

import torch

from vmcache.kernels.batched import attend_groups, plan_groups
from vmcache.kernels.cpu_decode import serves
from vmcache.kernels.cpu_decode_plan import DecodeRows

# the last step's plan (SDPA groups, or the CPU decode kernel's checked plan), made by its
# first layer and read by the others: a memo of a pure function, kept for the step's ``lens``
# tensor (the same object for every layer of a step; a new step brings a new one)
_LAST_PLAN: list = [None]


def _step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: torch.Tensor,
                    layout: torch.Tensor, write: torch.Tensor, read: torch.Tensor,
                    lens: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """See the module docstring: → ``[N, N_Q, d_h]`` in q's dtype."""
    rows, width, k_at, v_at = layout.tolist()
    b, span = read.shape
    last = _LAST_PLAN[0]
    if (last is not None and last[0]() is lens and last[1] == span and last[2] is read
            and last[3] is write):  # fmt: skip
        groups = last[4]
    else:  # the step's first layer plans for all of them
        q_lens, kv_lens = lens.tolist()
        kernel = serves(q, store.dtype) and k.dtype == store.dtype
        if kernel and all(n == 1 for n in q_lens):
            # decodes only: the CPU kernel stores the new rows and reads the rows where they lie
            groups = DecodeRows(read, lens[1], rows, q.shape[1], q.shape[2], write)
        elif kernel and max(q_lens) <= SHORT_PREFILL:
            groups = _short(q_lens, kv_lens, read, write, rows, q.shape[1], q.shape[2])
        elif kernel and 1 in q_lens:
            groups = _Mixed.plan(q_lens, kv_lens, read, write, rows, q.shape[1], q.shape[2])
        else:
            lo = torch.zeros(b, dtype=torch.long)
            groups = plan_groups(q_lens, kv_lens, lo, span, None, q.device)
        _LAST_PLAN[0] = (weakref.ref(lens), span, read, write, groups)
    if isinstance(groups, DecodeRows):
        return groups(q, store, (rows, width, k_at, v_at), scale, k, v)
    if isinstance(groups, _Mixed):
        return groups(q, k, v, store, (rows, width, k_at, v_at), scale)
    return _gathered(q, k, v, store, (rows, width, k_at, v_at), write, read, groups, scale)


def _gathered(q, k, v, store, layout, write, read, groups, scale) -> torch.Tensor:
    """The new K/V stored (``index_copy_``), every history gathered, SDPA by groups."""
    rows, width, k_at, v_at = layout
    b, span = read.shape
    k_rows = store.as_strided((rows, width), (width, 1), k_at)
    v_rows = store.as_strided((rows, width), (width, 1), v_at)
    k_rows.index_copy_(0, write, k.to(k_rows.dtype))
    v_rows.index_copy_(0, write, v.to(v_rows.dtype))
    heads_kv = width // q.shape[2]
    flat = read.reshape(-1)
    keys = k_rows.index_select(0, flat).view(b, span, heads_kv, q.shape[2])
    values = v_rows.index_select(0, flat).view(b, span, heads_kv, q.shape[2])
    out = attend_groups(q.to(k_rows.dtype), keys, values, groups, scale)
    return out.to(q.dtype)


# Prefills of at most this many tokens go through the CPU decode kernel as one query each
# (below), not gathered for SDPA: a prompt's tail behind its cached prefix (the prefix index
# hits in 16-token units, so the tail it leaves is 1 to 16 tokens), a short chat turn. 64
# streaming clients on SmolLM2 (tails of 1-16 tokens behind ~500 cached, 2026-12-07): the
# step that prefills all 64 took 1.76 s at 8 (the longer tails gathered), 1.31 s at 16 and
# 1.30 s at 32 (its GEMMs 0.74 s)
SHORT_PREFILL = 16


def _short(q_lens, kv_lens, read, write, rows, heads, dim) -> DecodeRows:
    """A step whose prefills are short, as decodes: token j of a sequence's n new ones is one
    query over the first kv_len − n + j + 1 rows of that sequence's ``read`` (causal), so every
    token goes through the CPU kernel, its rows read where they lie, nothing gathered. 64
    streaming clients sending prompts whose prefix was cached (SmolLM2, ~7 new tokens each)
    spent ~10 % of the server's engine time gathering histories for those prefills."""
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    lens = [k - n + j + 1 for n, k in zip(q_lens, kv_lens) for j in range(n)]
    return DecodeRows(read.index_select(0, seq), torch.tensor(lens), rows, heads, dim, write)


class _Mixed:
    """A step of decodes and prefills: the decodes through the CPU kernel (their rows read
    where they lie), only the prefills' histories gathered for SDPA. Gathering every
    sequence's history for a step that prefills one prompt beside fifteen decodes took a
    quarter of a server's engine time at 16 streaming clients (SmolLM2, ~400-token contexts)."""

    def __init__(self, dec_q, decode, pre_q, pre_write, pre_read, groups) -> None:
        self.dec_q, self.decode, self.pre_q = dec_q, decode, pre_q
        self.pre_write, self.pre_read, self.groups = pre_write, pre_read, groups

    @classmethod
    def plan(cls, q_lens, kv_lens, read, write, rows, heads, dim) -> _Mixed:
        starts = [0]
        for n in q_lens[:-1]:
            starts.append(starts[-1] + n)
        dec = [i for i, n in enumerate(q_lens) if n == 1]
        pre = [i for i, n in enumerate(q_lens) if n != 1]
        dec_q = torch.tensor([starts[i] for i in dec], dtype=torch.long)
        pre_q = torch.tensor([t for i in pre for t in range(starts[i], starts[i] + q_lens[i])],
                             dtype=torch.long)  # fmt: skip
        dec_seqs = torch.tensor(dec, dtype=torch.long)
        decode = DecodeRows(read.index_select(0, dec_seqs),
                            torch.tensor([kv_lens[i] for i in dec]), rows, heads, dim,
                            write.index_select(0, dec_q))  # fmt: skip
        span = max(kv_lens[i] for i in pre)
        pre_read = read.index_select(0, torch.tensor(pre, dtype=torch.long))[:, :span]
        lo = torch.zeros(len(pre), dtype=torch.long)
        groups = plan_groups([q_lens[i] for i in pre], [kv_lens[i] for i in pre], lo, span,
                             None, read.device)  # fmt: skip
        return cls(dec_q, decode, pre_q, write.index_select(0, pre_q), pre_read.contiguous(),
                   groups)  # fmt: skip

    def __call__(self, q, k, v, store, layout, scale) -> torch.Tensor:
        out = torch.empty_like(q)
        dec = self.decode(q.index_select(0, self.dec_q), store, layout, scale,
                          k.index_select(0, self.dec_q), v.index_select(0, self.dec_q))  # fmt: skip
        out.index_copy_(0, self.dec_q, dec)
        pre = _gathered(q.index_select(0, self.pre_q), k.index_select(0, self.pre_q),
                        v.index_select(0, self.pre_q), store, layout, self.pre_write,
                        self.pre_read, self.groups, scale)  # fmt: skip
        out.index_copy_(0, self.pre_q, pre)
        return out


# The operator is defined through torch.library.Library (its kernel a plain Python function the
# dispatcher calls; ~4 µs a call) rather than the torch.library.custom_op decorator, whose
# Python layers (argument defaults, in-place bookkeeping) took ~20 µs of each layer's call.
# One kernel for every device (CompositeExplicitAutograd); the step runs in inference mode.
_LIB = torch.library.Library("vmcache", "FRAGMENT")  # kept: the registration lives with it
_LIB.define("step_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) store, Tensor layout, "
            "Tensor write, Tensor read, Tensor lens, float scale) -> Tensor")  # fmt: skip
_LIB.impl("step_attention", _step_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("vmcache::step_attention", lib=_LIB)
def _(q, k, v, store, layout, write, read, lens, scale):
    return torch.empty_like(q)


step_attention = torch.ops.vmcache.step_attention


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
