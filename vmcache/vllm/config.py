"""The settings of vmcache under vLLM, read from vLLM's plugin config (``additional_config``,
``--additional-config '{"vmcache": {...}}'``): untrusted input, checked before anything is
built.

    ledger            a vmcache ledger file (:class:`vmcache.memory.ledger.SharedBudget`) that
                      several processes draw on; None: this process's own limit
    budget_mib        the KV memory this engine may hold (no ledger), or the ledger's total when
                      this process creates it (with a ledger); None: vLLM's whole KV space
    floor_mib         with a ledger: guaranteed to this engine whatever the others hold;
                      None: one max_model_len sequence
    name              the label the ledger shows (``vmcache-kv show``)
    prefix_cache_mib  freed blocks that keep a prefix-cache hash stay resident up to this much;
                      past it the least recently used give their memory back. None: a tenth of
                      the KV space
    chunk_blocks      blocks taken from the budget at a time, and kept free between steps
    lock_timeout_s    the longest a ledger call waits for another process's transaction
                      before it goes on in a rebuilt ledger
    lease_s           with a ledger: kept by a thread of its own; a stopped engine
                      loses its blocks' budget after this long
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

MIB = 2**20


@dataclass(frozen=True)
class VllmKVConfig:
    ledger: str | None = None
    budget_mib: float | None = None
    floor_mib: float | None = None
    name: str = "vllm"
    prefix_cache_mib: float | None = None
    chunk_blocks: int = 4
    lock_timeout_s: float = 2.0  # the ledger's lock bound (SERVING_LOCK_TIMEOUT_S)
    lease_s: float = 5.0  # the ledger lease its own thread keeps (SERVING_LEASE_S)

    def __post_init__(self) -> None:
        if self.ledger is not None and (not isinstance(self.ledger, str) or not self.ledger):
            raise ValueError(f"vmcache.ledger must be a file path, got {self.ledger!r}")
        for key in ("budget_mib", "floor_mib", "prefix_cache_mib"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v < 0):  # fmt: skip
                raise ValueError(f"vmcache.{key} must be a non-negative number of MiB, got {v!r}")
        if self.floor_mib is not None and self.ledger is None:
            raise ValueError("vmcache.floor_mib needs vmcache.ledger (a floor is a share of one)")
        if not isinstance(self.name, str) or not 0 < len(self.name) <= 256:
            raise ValueError(f"vmcache.name must be 1 to 256 characters, got {self.name!r}")
        if isinstance(self.chunk_blocks, bool) or not isinstance(self.chunk_blocks, int) \
                or not 1 <= self.chunk_blocks <= 4096:  # fmt: skip
            raise ValueError(f"vmcache.chunk_blocks must be an int in [1, 4096], got "
                             f"{self.chunk_blocks!r}")  # fmt: skip
        t = self.lock_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 600:
            raise ValueError(f"vmcache.lock_timeout_s must be in (0, 600] seconds, got {t!r}")
        t = self.lease_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.1 <= t <= 3600:
            raise ValueError(f"vmcache.lease_s must be in [0.1, 3600] seconds, got {t!r}")

    @classmethod
    def from_additional(cls, additional_config: object) -> VllmKVConfig:
        """The ``"vmcache"`` entry of vLLM's ``additional_config`` (absent: the defaults)."""
        if additional_config is None:
            return cls()
        if not isinstance(additional_config, dict):
            raise TypeError(f"additional_config must be a dict, got {type(additional_config)}")
        raw = additional_config.get("vmcache", {})
        if not isinstance(raw, dict):
            raise TypeError(f'additional_config["vmcache"] must be an object, got {raw!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown vmcache settings {unknown}; known: {sorted(known)}")
        return cls(**raw)

    def blocks(self, mib: float, block_bytes: int) -> int:
        """Whole blocks of ``block_bytes`` in ``mib`` MiB."""
        return int(mib * MIB) // block_bytes
