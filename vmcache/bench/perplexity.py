"""K/V storage quality on a trained model: perplexity of real English text, teacher-forced in
chunks through the drop-in cache, so every chunk after the first attends over K/V as stored
(FP8 / INT8 rows dequantized in the attention), for each storage of :data:`STORAGES`.

    ppl = exp(mean over t of −log p(x_t | x_<t)),   t = 1 .. T−1

    chunk 0: tokens [0, C)   -> logits for 1 .. C        (its own K/V written, then read)
    chunk 1: tokens [C, 2C)  -> logits for C+1 .. 2C     (over chunk 0's stored K/V)

The texts need no download: the Apache License 2.0 (the project's LICENSE file, shipped in
its sdist and wheel) and the docstrings of a fixed list of standard-library modules. Head
scales are calibrated (``calibrate_kv_scales``) on the *other* text's first 512 tokens, never
on the text they are measured on. The anchor is transformers' ``QuantizedCache`` (quanto,
INT4 / INT2 per group of 64, its last 128 tokens in full precision) when optimum-quanto is
installed.
"""

from __future__ import annotations

import importlib
import inspect
import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
STDLIB_MODULES = ("argparse", "asyncio", "collections", "contextlib", "dataclasses",
                  "functools", "heapq", "itertools", "json", "logging", "pathlib", "re",
                  "shutil", "subprocess", "threading", "typing", "unittest", "zipfile")  # fmt: skip
CHUNK, MAX_TOKENS, CALIBRATION_TOKENS = 256, 2048, 512
E4, E5, I8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
# name: (kv_dtype, granularity "head" | "token", calibration: None (scales 1) or the keyword
#        arguments of calibrate_kv_scales, {} its defaults), or the anchor ("quanto", bits, None)
STORAGES = {
    "fp32 (compute dtype)": (None, "head", None),
    "bf16": (torch.bfloat16, "head", None),
    "fp8 e4m3, unit scales": (E4, "head", None),
    "fp8 e4m3, calibrated (default)": (E4, "head", {}),
    "fp8 e4m3, calibrated, range fitted": (E4, "head", {"range_fit": True}),
    "fp8 e4m3, calibrated, range fitted x4": (E4, "head", {"range_fit": True, "margin": 4.0}),
    "fp8 e4m3, per token": (E4, "token", None),
    "fp8 e5m2, unit scales": (E5, "head", None),
    "fp8 e5m2, per token": (E5, "token", None),
    "int8, calibrated (default: p99.9)": (I8, "head", {}),
    "int8, calibrated amax": (I8, "head", {"percentile": 100}),
    "int8, calibrated amax x1.25": (I8, "head", {"percentile": 100, "margin": 1.25}),
    "int8, calibrated amax x1.5": (I8, "head", {"percentile": 100, "margin": 1.5}),
    "int8, calibrated p99": (I8, "head", {"percentile": 99.0}),
    "int8, per token": (I8, "token", None),
    "transformers QuantizedCache int4": ("quanto", 4, None),
    "transformers QuantizedCache int2": ("quanto", 2, None),
}


def texts() -> dict[str, str]:
    """The two texts, as they are on this machine (their token counts go into the JSON)."""
    stdlib = []
    for name in STDLIB_MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc:
            stdlib.append(doc)
    return {"apache-2.0": (ROOT / "LICENSE").read_text(), "stdlib-docs": "\n\n".join(stdlib)}


def _cache(model, storage: str, scales, total: int):
    from vmcache.hf import VMCache

    kv, how, _ = STORAGES[storage]
    if kv == "quanto":
        from transformers.cache_utils import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=how,
                              residual_length=128, q_group_size=64)  # fmt: skip
    if kv is None:
        return VMCache(config=model.config, max_cache_len=total)
    if kv is torch.bfloat16:
        return VMCache(config=model.config, max_cache_len=total, dtype=torch.bfloat16)
    return VMCache(config=model.config, max_cache_len=total, kv_dtype=kv, kv_scales=scales,
                   kv_granularity=how)  # fmt: skip


@torch.inference_mode()
def nll(model, ids: list[int], cache, chunk: int = CHUNK) -> tuple[float, list[int]]:
    """(mean negative log-likelihood of ids[1:], the argmax prediction at every position)."""
    from vmcache.hf import cache_keyword

    key = cache_keyword(model)
    total, argmax, n = 0.0, [], 0
    x = torch.tensor([ids])
    for lo in range(0, len(ids) - 1, chunk):
        hi = min(lo + chunk, len(ids) - 1)
        out = model(input_ids=x[:, lo:hi], **{key: cache}, use_cache=True)
        logp = out.logits[0].float().log_softmax(-1)
        target = x[0, lo + 1 : hi + 1]
        total -= float(logp.gather(1, target[:, None]).sum())
        argmax += logp.argmax(-1).tolist()
        n += hi - lo
    return total / n, argmax


def calibration(model, tokenizer, storage: str, other_text: str):
    from vmcache.hf import calibrate_kv_scales

    kv, _, how = STORAGES[storage]
    if how is None:
        return None
    ids = torch.tensor([tokenizer(other_text)["input_ids"][:CALIBRATION_TOKENS]])
    return calibrate_kv_scales(model, ids, kv, **how)


def rows(model, tokenizer, storages=tuple(STORAGES), max_tokens: int = MAX_TOKENS) -> list:
    from vmcache.bench.quant import quanto_available

    corpus = texts()
    out = []
    for name, text in corpus.items():
        other = next(t for n, t in corpus.items() if n != name)
        ids = tokenizer(text)["input_ids"][:max_tokens]
        base_nll, base_argmax = None, None
        for storage in storages:
            kv = STORAGES[storage][0]
            row = {"text": name, "tokens": len(ids), "storage": storage,
                   "kv_dtype": str(kv) if kv is not None else "compute"}  # fmt: skip
            if kv == "quanto" and not quanto_available():
                out.append({**row, "note": "optimum-quanto not installed"})
                continue
            scales = calibration(model, tokenizer, storage, other)
            t0 = time.perf_counter()
            mean, argmax = nll(model, ids, _cache(model, storage, scales, len(ids) + 1))
            if base_nll is None:
                base_nll, base_argmax = mean, argmax
            agree = sum(a == b for a, b in zip(argmax, base_argmax)) / len(argmax)
            how = STORAGES[storage][2]
            out.append({**row, "calibration": "-" if how is None else
                        (", ".join(f"{k}={v}" for k, v in how.items()) or "defaults"),
                        "nll": mean, "ppl": math.exp(mean), "ppl_vs_compute": math.exp(mean -
                        base_nll), "top1_agreement": agree,
                        "wall_s": time.perf_counter() - t0})  # fmt: skip
            print(f"  {name:12s} {storage:36s} ppl {math.exp(mean):8.4f}  "
                  f"top-1 vs compute {agree:.4f}", flush=True)  # fmt: skip
    return out
