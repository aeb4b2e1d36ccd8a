"""One model layer's view of a drop-in cache (transformers' ``CacheLayerMixin``): it records
its length and forwards to its owner (:class:`~vmcache.hf.VMCache` / ``PagedCache``), which
alone changes tables; and :func:`cache_keyword`, how a transformers version takes the cache.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import CacheLayerMixin


@functools.cache
def _cache_keyword(forward) -> str:
    params = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{forward.__qualname__} takes neither cache= nor past_key_values=")


def cache_keyword(module) -> str:  # a module or its class
    """The keyword ``module.forward`` takes the cache by: ``past_key_values`` in
    transformers 5.17–5.23, ``cache`` from 5.24 on (where ``past_key_values`` is deprecated
    at the top level and swallowed silently by a decoder layer). Feature-tested, once per
    class."""
    return _cache_keyword((module if isinstance(module, type) else type(module)).forward)


class _Layer(CacheLayerMixin):
    """One model layer's view of the shared cache: its length; storage is the owner's."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, owner, idx: int) -> None:
        super().__init__()
        self.owner, self.idx, self.length = owner, idx, 0
        windows = owner.spec.layer_windows
        self.is_sliding = windows is not None and windows[idx] is not None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.owner._initialize(key_states)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys, first key's position) of what update() will return: a sliding layer's
        keys start at its window's first mapped token (what the next grow keeps)."""
        offset = self.owner._window_offset(self.idx)
        return self.length + query_length - offset, offset

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.owner.max_cache_len

    # transformers' layers hold ``[batch, heads, length, head_dim]`` keys and values, which
    # user code and generation utilities read: ours are what ``update`` returned, made on
    # access (VMCache: views of the cache, no copy; PagedCache: gathered), so no layer keeps a
    # second copy between steps. None before the first update; not assignable.
    keys = property(lambda self: self._kv(0), lambda self, value: _read_only(value))
    values = property(lambda self: self._kv(1), lambda self, value: _read_only(value))

    def _kv(self, i: int) -> torch.Tensor | None:
        return self.owner._layer_kv(self, real=True)[i] if self.length else None

    @property
    def batch_size(self) -> int:
        return len(self.owner.rows)


def _read_only(value) -> None:
    if value is not None:  # transformers' own __init__ writes None: nothing to store
        raise AttributeError("a vmcache layer's keys and values are views of the cache's "
                             "storage (read them; write through the model's forward)")  # fmt: skip
