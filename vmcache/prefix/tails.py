"""Hits finer than a span: every entry of the prefix index is also found by each 16-token
unit that begins it, so a cache whose span is long (a VM page of 64 KiB holds 85 tokens of a
768-byte row: 256-token spans) still hits a prompt that shares less than a span, as a
16-token paged cache does. A sequence's partial last span is indexed too (a tail entry).

    span j (full entry, or a published sequence's tail):  | t0 ... t207 | t208 ... |
    found by its unit prefixes:  (parent, t0..t15), (parent, t0..t31), ..., (parent, t0..t207)

A unit hit maps the pages its tokens lie in into the new sequence, its length the tokens
matched; the page it writes next is shared (index and sequence), so the write copies it first
(copy on write), as it does for a fork: the indexed page keeps the indexed tokens' K/V. A tail
is a leaf of the index (never a parent), evicted like any entry, never demoted to the tiers.
A page belongs to one entry: a tail is skipped when one of its pages is indexed, and dropped
when the span it began is indexed whole (whose units then find the same tokens). Keys hold a
hash of the unit prefix; a hit is checked against the entry's own tokens (a collision is a
miss). This class owns the keys only; the index owns the entries and their references.
"""

from __future__ import annotations

from collections.abc import Sequence

UNIT_TOKENS = 16  # the finest hit: vLLM's default block size, the paged cache's


class Tails:
    def __init__(self, unit: int, span: int) -> None:
        self.unit, self.span = unit, span
        self._keys: dict[tuple, object] = {}  # key -> the entry it finds (first wins)

    @staticmethod
    def _key(parent, tokens: Sequence[int], salt) -> tuple:
        return (id(parent), salt, len(tokens), hash(tuple(tokens)))

    def units(self, n_tokens: int) -> int:
        """Whole units a unit hit can take of a span's first ``n_tokens`` (a span less one
        token: a whole span is the index's own match)."""
        return min(n_tokens, self.span - 1) // self.unit

    def find(self, parent, rest: Sequence[int], salt) -> tuple[object | None, int]:
        """(the entry after ``parent`` sharing the most whole units with ``rest``, the tokens
        shared); (None, 0) when none. An entry's key holds its span's tokens (``key[1]``)."""
        for m in range(self.units(len(rest)), 0, -1):
            n = m * self.unit
            e = self._keys.get(self._key(parent, rest[:n], salt))
            if e is not None and tuple(e.key[1][:n]) == tuple(rest[:n]):
                return e, n
        return None, 0

    def register(self, entry, parent, tokens: Sequence[int], salt) -> tuple:
        """Every unit prefix of ``tokens`` (``entry``'s span) not yet finding another entry
        now finds ``entry``; returns the keys it holds."""
        held = []
        for m in range(1, self.units(len(tokens)) + 1):
            k = self._key(parent, tokens[: m * self.unit], salt)
            if k not in self._keys:
                self._keys[k] = entry
                held.append(k)
        return tuple(held)

    def unregister(self, entry, keys: tuple) -> None:
        for k in keys:
            if self._keys.get(k) is entry:
                del self._keys[k]

    def clear(self) -> None:
        self._keys.clear()
