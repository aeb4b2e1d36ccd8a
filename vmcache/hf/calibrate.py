"""Per-layer, per-KV-head scales for FP8 / INT8 K/V from a model's own activations (what vLLM
calibrates when a checkpoint carries no k/v scales): run the model once over sample tokens
with transformers' ``DynamicCache`` and take each head's largest |K| and |V| (or a percentile).

    INT8:  s[layer, K|V, head] = max(amax · margin / 127, tiny)          margin 1.25 by default
    FP8:   s[layer, K|V, head] = max(amax · margin / q_max, 1)            (range_fit=False)

The defaults come from the perplexity table in docs/results.md (SmolLM2-135M, real text, the
scales calibrated on another text): INT8 needs its range fitted, and 25% headroom beat the
sample's own amax (activations on other text run past it); a 99th percentile saturated too
much. FP8 is floating point: scaling a head's values up to fill its range pushed the many
small ones below the normal range and cost perplexity at every margin tried, so by default
FP8 scales only shrink what would overflow, and stay 1 otherwise (``range_fit=True``: fit
the range anyway).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from vmcache.hf.layer import cache_keyword
from vmcache.sequences.quant import Q_MAX

DEFAULT_MARGIN = {torch.int8: 1.25}  # FP8: 1.0


@torch.inference_mode()
def calibrate_kv_scales(model, input_ids: torch.Tensor, kv_dtype: torch.dtype,
                        margin: float | None = None, percentile: float | None = None,
                        range_fit: bool | None = None) -> tuple[float, ...]:  # fmt: skip
    """``kv_scales`` for ``KVSpec`` / ``VMCache(kv_dtype=, kv_scales=)``: a flat tuple of
    ``[layer][K, V][KV head]`` from one forward pass over ``input_ids`` ``[b, T]``.
    ``margin``: headroom over the sample's values (default 1.25 for INT8, 1.0 for FP8).
    ``percentile`` (e.g. 99.9): that percentile of each head's |K| (|V|) instead of its
    largest. ``range_fit``: scale so the largest value meets the format's largest (default
    for INT8), or only shrink what would overflow (default for FP8; see the module)."""
    if kv_dtype not in Q_MAX:
        raise ValueError(f"kv_dtype must be one of {sorted(map(str, Q_MAX))}, got {kv_dtype!r}")
    margin = DEFAULT_MARGIN.get(kv_dtype, 1.0) if margin is None else margin
    if (
        isinstance(margin, bool)
        or not isinstance(margin, (int, float))
        or not (0 < margin < float("inf"))
    ):
        raise ValueError(f"margin must be a positive finite number, got {margin!r}")
    if percentile is not None and (
        isinstance(percentile, bool) or not isinstance(percentile, (int, float))
        or not 0 < percentile <= 100
    ):  # fmt: skip
        raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
    fit = kv_dtype == torch.int8 if range_fit is None else bool(range_fit)
    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, **{cache_keyword(model): cache}, use_cache=True)
    out: list[float] = []
    for layer in cache.layers:
        for x in (layer.keys, layer.values):  # [b, N_KV, T, d_h]
            mag = x.float().abs().transpose(0, 1).flatten(1)  # [N_KV, b·T·d_h]
            if percentile is None:
                top = mag.amax(dim=1)
            else:
                k = max(1, min(mag.shape[1], round(percentile / 100 * mag.shape[1])))
                top = mag.kthvalue(k, dim=1).values  # (quantile() refuses > 16M values)
            scale = top * margin / Q_MAX[kv_dtype]
            out += (scale.clamp(min=1e-8) if fit else scale.clamp(min=1.0)).tolist()
    return tuple(out)
