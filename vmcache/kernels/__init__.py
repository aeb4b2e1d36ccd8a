"""Attention straight from either cache. Plan once per step (lengths, tables), run per layer.

``decode(cache, layer, q, seq_ids)``: q ``[B, N_Q, d_h]`` (one new token per sequence, whose
K/V are already written) → ``[B, N_Q, d_h]``.
``prefill(cache, layer, q, seq_ids, q_lens)``: q packed ``[Σ q_lens, N_Q, d_h]`` (varlen); the
last ``q_lens[i]`` positions of sequence i are the queries' own; causal → same shape as q.
"""

from vmcache.kernels.api import attend, decode, prefill
from vmcache.kernels.reference import dense_attention, paged_decode_reference

__all__ = ["attend", "decode", "prefill", "dense_attention", "paged_decode_reference"]
