"""Per-layer, per-KV-head scales for FP8 / INT8 K/V from a model's own activations (what vLLM
calibrates when a checkpoint carries no k/v scales): run the model once over sample tokens
with transformers' ``DynamicCache`` and take each head's largest |K| and |V|.

    s[layer, K|V, head] = max(amax · margin / q_max, tiny)

``margin`` > 1 leaves headroom for activations larger than the sample's (saturated beyond).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from vmcache.sequences.quant import Q_MAX


@torch.inference_mode()
def calibrate_kv_scales(model, input_ids: torch.Tensor, kv_dtype: torch.dtype,
                        margin: float = 1.0) -> tuple[float, ...]:  # fmt: skip
    """``kv_scales`` for ``KVSpec`` / ``VMCache(kv_dtype=, kv_scales=)``: a flat tuple of
    ``[layer][K, V][KV head]`` from one forward pass over ``input_ids`` ``[b, T]``."""
    if kv_dtype not in Q_MAX:
        raise ValueError(f"kv_dtype must be one of {sorted(map(str, Q_MAX))}, got {kv_dtype!r}")
    if not isinstance(margin, (int, float)) or not 0 < margin < float("inf"):
        raise ValueError(f"margin must be a positive finite number, got {margin!r}")
    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    out: list[float] = []
    for layer in cache.layers:
        for x in (layer.keys, layer.values):  # [b, N_KV, T, d_h]
            amax = x.float().abs().amax(dim=(0, 2, 3))
            out += (amax * margin / Q_MAX[kv_dtype]).clamp_(min=1e-8).tolist()
    return tuple(out)
