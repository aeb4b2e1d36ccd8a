"""Typed errors shared by every cache.

Tiers (see docs/DESIGN.md): bad input raises ``ValueError``/``TypeError``/``KeyError``;
exhaustion raises :class:`CacheFull`; driver failures raise :class:`DriverError`
carrying the failing call's name; a broken internal invariant raises :class:`InvariantError`
(never a bare ``assert``, which ``python -O`` removes).
"""

from __future__ import annotations

from typing import Any


class CacheFull(RuntimeError):
    """The pool (or the slot table, or the host tier) cannot satisfy a request.

    Nothing was changed by the call that raised it.
    """

    def __init__(self, message: str, *, wanted: int = 0, free: int = 0) -> None:
        super().__init__(message)
        self.wanted = wanted
        self.free = free


class DriverError(RuntimeError):
    """A memory-mapping call failed; ``call`` names it, ``code`` is the driver's error name."""

    def __init__(self, call: str, code: str, detail: str = "") -> None:
        msg = f"{call} failed: {code}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)
        self.call = call
        self.code = code


class MapLimitError(DriverError):
    """The process ran out of memory mappings (Linux ``vm.max_map_count``)."""


def check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def check_tokens(name: str, ids) -> list[int]:
    if hasattr(ids, "tolist"):  # a tensor
        ids = ids.tolist()
    ids = list(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError(f"{name} must be a sequence of int token ids")
    return ids


class InvariantError(AssertionError):
    """An internal invariant does not hold (a bug in vmcache, never a user error)."""


def require(cond: bool, *detail: Any) -> None:
    """Raise :class:`InvariantError` with ``detail`` unless ``cond``; kept under ``-O``."""
    if not cond:
        raise InvariantError(", ".join(map(repr, detail)) if detail else "invariant violated")
