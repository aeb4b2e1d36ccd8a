"""Per-layer, per-KV-head scales for FP8 / INT8 K/V from a model's own activations (what vLLM
calibrates when a checkpoint carries no k/v scales): run the model once over sample tokens
with transformers' ``DynamicCache`` and take each head's largest |K| and |V| (or a percentile).

    INT8:  s[layer, K|V, head] = max(p99.9(|x|) · margin / 127, tiny)      margin 1 by default
    FP8:   s[layer, K|V, head] = max(amax · margin / q_max, 1)             (range_fit=False)

The defaults come from the perplexity table in docs/results.md (SmolLM2-135M, two real texts
of 2,048 tokens, the scales calibrated on the other text). INT8: a 99.9th percentile
(+0.16% / +0.41% perplexity) beat the sample's amax (+0.54% / +0.36%) and amax with 25% or
50% headroom (+0.59% / +0.70%, +1.38% / +0.15%). FP8 is floating point: fitting each head's
largest value to the format's (+2.12% / +1.55%) or a quarter of it (+2.71% / +1.11%) did not
beat unit scales (+2.91% / +0.68%) on both texts, so by default FP8 scales only shrink what
would overflow and stay 1 otherwise (``range_fit=True`` fits the range anyway). Per-token
scales (``kv_granularity="token"``) beat every head-scale row of their dtype.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from vmcache.hf.layer import cache_keyword
from vmcache.sequences.quant import Q_MAX

DEFAULT_PERCENTILE = {torch.int8: 99.9}  # FP8: the largest value


@torch.inference_mode()
def calibrate_kv_scales(model, input_ids: torch.Tensor, kv_dtype: torch.dtype,
                        margin: float | None = None, percentile: float | None = None,
                        range_fit: bool | None = None) -> tuple[float, ...]:  # fmt: skip
    """``kv_scales`` for ``KVSpec`` / ``VMCache(kv_dtype=, kv_scales=)``: a flat tuple of
    ``[layer][K, V][KV head]`` from one forward pass over ``input_ids`` ``[b, T]``.
    ``margin``: headroom over the sample's values (default 1). ``percentile``: that
    percentile of each head's |K| (|V|) rather than its largest (default 99.9 for INT8, the
    largest for FP8; 100 is the largest). ``range_fit``: scale so that value meets the
    format's largest (default for INT8), or only shrink what would overflow (default for
    FP8; see the module)."""
    if kv_dtype not in Q_MAX:
        raise ValueError(f"kv_dtype must be one of {sorted(map(str, Q_MAX))}, got {kv_dtype!r}")
    margin = 1.0 if margin is None else margin
    percentile = DEFAULT_PERCENTILE.get(kv_dtype) if percentile is None else percentile
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
            if percentile is None or percentile == 100:
                top = mag.amax(dim=1)
            else:
                k = max(1, min(mag.shape[1], round(percentile / 100 * mag.shape[1])))
                top = mag.kthvalue(k, dim=1).values  # (quantile() refuses > 16M values)
            scale = top * margin / Q_MAX[kv_dtype]
            out += (scale.clamp(min=1e-8) if fit else scale.clamp(min=1.0)).tolist()
    return tuple(out)
