"""The trained model the harness's real-model rows run on: by default the embedded
SmolLM2-135M-Instruct (vmcache.models), or what ``--real-model`` names (anything
``vmcache.models.load`` takes: an embedded name, a checkpoint directory, a .gguf file; a chat
model, its template builds the prompts), loaded once per process. The rows run when the model
is there (`make bench` and `make test` fetch the embedded one first); otherwise each mode says
it skipped them."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from vmcache.models import DEFAULT_MODEL, EMBEDDED, ModelFetchError, chat_ids, fetch, load

NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)"


def available(name: str = DEFAULT_MODEL) -> bool:
    """Whether ``name`` is there: an embedded model cached and intact (nothing is downloaded
    here), or a path that exists."""
    if name not in EMBEDDED:
        return Path(name).expanduser().exists()
    try:
        fetch(name, download=False)
    except (ModelFetchError, ValueError):
        return False
    return True


def label(name: str = DEFAULT_MODEL) -> str:
    """What the tables and a results file's header call the model."""
    return NAME if name == DEFAULT_MODEL else row_name(name)


def row_name(name: str = DEFAULT_MODEL) -> str:
    """What a row's ``model`` field says: an embedded name as it is, a path by its last part
    (committed results never hold a machine's own paths)."""
    return name if name in EMBEDDED else Path(name).expanduser().name


@functools.cache
def smol(name: str = DEFAULT_MODEL):
    """(model fp32 eval, tokenizer) of ``name``, loaded once per process."""
    torch.manual_seed(0)
    return load(name, dtype=torch.float32)


def chat(tokenizer, user: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    return chat_ids(tokenizer, msgs)
