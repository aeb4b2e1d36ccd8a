"""Loading a trained checkpoint for the engine and the drop-in: one entry, three sources.

    model, tokenizer = load()                                  # the embedded default model
    model, tokenizer = load("smollm2-135m-instruct")           # the same, by name
    model, tokenizer = load("/path/to/checkpoint")             # a transformers directory
    model, tokenizer = load("/path/to/model.Q4_1.gguf")        # a GGUF file

The architecture is checked from the config before any weight is read: the engine's runner
drives the decoder layers of the families in :data:`SUPPORTED` (the ones its tests run). GGUF
weights are dequantized to ``dtype`` by transformers (it needs the ``gguf`` package: the
``models`` extra). Nothing of the returned model is changed: its attention implementation is
transformers' default unless ``attn_implementation`` says otherwise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vmcache.models import converted
from vmcache.models.embedded import DEFAULT_MODEL, EMBEDDED, fetch

# transformers model_type -> what the engine's runner has been tested on
SUPPORTED = {"llama": "Llama (SmolLM2, Llama 2/3, TinyLlama)", "mistral": "Mistral",
             "qwen2": "Qwen2 / Qwen2.5", "gemma2": "Gemma 2",
             "gemma3_text": "Gemma 3 (text)"}  # fmt: skip


class UnsupportedModel(ValueError):
    """A checkpoint whose architecture the engine does not run."""


def resolve(name_or_path: str | Path = DEFAULT_MODEL, cache_dir: Path | str | None = None,
            download: bool = True) -> tuple[Path, str | None]:  # fmt: skip
    """(directory, GGUF file name or None) for a name of :data:`EMBEDDED`, a ``.gguf`` file
    or a transformers checkpoint directory."""
    if isinstance(name_or_path, str) and name_or_path in EMBEDDED:
        path = fetch(name_or_path, cache_dir, download)
        return path.parent, path.name
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} holds no config.json: not a transformers checkpoint")
        return path, None
    if path.exists():
        raise ValueError(f"{path}: expected a .gguf file or a checkpoint directory")
    raise FileNotFoundError(f"no model {str(name_or_path)!r}: not an embedded name "
                            f"({', '.join(EMBEDDED)}), a .gguf file or a checkpoint "
                            "directory")  # fmt: skip


def checkpoint_dir(name_or_path: str | Path = DEFAULT_MODEL, *,
                   dtype: torch.dtype = torch.float32, cache_dir: Path | str | None = None,
                   download: bool = True) -> Path:  # fmt: skip
    """A transformers checkpoint directory for ``name_or_path``, for loaders that read only
    those (tensor parallelism's sharded load): a directory as it is, an embedded model's
    converted copy in ``dtype`` (written once); a ``.gguf`` file is refused with what to do."""
    directory, gguf = resolve(name_or_path, cache_dir, download)
    if gguf is None:
        return directory
    if isinstance(name_or_path, str) and name_or_path in EMBEDDED:
        return converted.ensure(directory / gguf, EMBEDDED[name_or_path], dtype)
    raise ValueError(f"{name_or_path}: a .gguf file, not a checkpoint directory; load it once "
                     "with vmcache.models.load and save_pretrained it")  # fmt: skip


def check_supported(config) -> str:
    """The config's ``model_type`` if the engine runs it; :class:`UnsupportedModel` else."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        names = ", ".join(f"{k} ({v})" for k, v in SUPPORTED.items())
        raise UnsupportedModel(f"model type {kind!r} is not supported by the engine; "
                               f"supported: {names}")  # fmt: skip
    return kind


def load(name_or_path: str | Path = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32,
         device: torch.device | str = "cpu", cache_dir: Path | str | None = None,
         download: bool = True, attn_implementation: str | None = None):  # fmt: skip
    """``(model, tokenizer)``: a causal LM in eval mode on ``device`` in ``dtype``, and its
    tokenizer (with its chat template when the checkpoint has one). An embedded model is read
    from its converted copy in ``dtype`` (:mod:`vmcache.models.converted`: ~3 s) once one
    exists; the first load converts its GGUF file (~30 s on 2 cores) and writes that copy."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    directory, gguf = resolve(name_or_path, cache_dir, download)
    if isinstance(name_or_path, str) and name_or_path in EMBEDDED:
        directory, gguf = converted.ensure(directory / gguf, EMBEDDED[name_or_path], dtype), None
    kw = {"gguf_file": gguf} if gguf else {}
    check_supported(AutoConfig.from_pretrained(directory, **kw))
    tokenizer = AutoTokenizer.from_pretrained(directory, **kw)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kw, **extra)
    return model.to(device).eval(), tokenizer


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The token ids of ``messages`` (``[{"role": ..., "content": ...}]``) under the
    tokenizer's chat template, ready to generate the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; tokenize the prompt yourself")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)  # fmt: skip
    ids = out["input_ids"] if hasattr(out, "keys") else out
    if ids and isinstance(ids[0], list):  # a batch of one
        (ids,) = ids
    return [int(t) for t in ids]
