"""The trained model the harness's real-model rows run on: the embedded SmolLM2-135M-Instruct
(vmcache.models), loaded once per process, and chat prompts from its own template. The rows
run when the model is cached (`make bench` and `make test` fetch it first); otherwise each
mode says it skipped them."""

from __future__ import annotations

import functools

import torch

from vmcache.models import DEFAULT_MODEL, ModelFetchError, chat_ids, fetch, load

NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)"


def available() -> bool:
    """Whether the embedded model is cached and intact (nothing is downloaded here)."""
    try:
        fetch(DEFAULT_MODEL, download=False)
    except (ModelFetchError, ValueError):
        return False
    return True


@functools.cache
def smol():
    """(model fp32 eval, tokenizer), loaded once per process."""
    torch.manual_seed(0)
    return load(DEFAULT_MODEL, dtype=torch.float32)


def chat(tokenizer, user: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    return chat_ids(tokenizer, msgs)
