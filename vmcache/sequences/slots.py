"""Slots: the one owner of per-sequence state, every change to it a method here.

    slot:    0      1      2      3      ...  max_seqs − 1
    live:    T      F      T      F
    length:  37     0      5      0            tokens whose K/V the pages hold
    tokens:  [..37] None   None   None         token ids of positions [0, length), or None
    salt:    "a"    None   None   None         the tenant's prefix-index salt
    free:    [3, 1]                            slots new_sequence / fork take (from the end)

The coordinator and its facets (beams, handoff, elastic, prefix, views; the kernels' plan
through ``views.lengths``) read through the queries; only this file assigns the fields. A
sequence's token ids are known only while they cover exactly its length (``tokens(s)`` is
None otherwise): a change that would break that forgets them.
"""

from __future__ import annotations


class Slots:
    """Slots, lengths, token ids and salts of ``max_seqs`` sequences (owned here)."""

    def __init__(self, max_seqs: int) -> None:
        self.max_seqs = max_seqs
        self._lens = [0] * max_seqs
        self._live = [False] * max_seqs
        self._free = list(range(max_seqs - 1, -1, -1))  # taken from the end: 0 first
        self._tokens: list[list[int] | None] = [None] * max_seqs
        self._salts: list[object] = [None] * max_seqs

    # --- queries -------------------------------------------------------------------------
    def length(self, s: int) -> int:
        return self._lens[s]

    def lengths(self, seqs) -> list[int]:
        return [self._lens[s] for s in seqs]

    def is_live(self, s: int) -> bool:
        return self._live[s]

    def live(self) -> list[int]:
        return [s for s in range(self.max_seqs) if self._live[s]]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, s: int) -> bool:
        return s in self._free

    def free_slots(self) -> list[int]:
        return list(self._free)

    def tokens(self, s: int) -> list[int] | None:
        """A copy of ``s``'s token ids (positions ``[0, length)``), or None when unknown."""
        known = self._tokens[s]
        return None if known is None else list(known)

    def known_tokens(self, s: int) -> int | None:
        """How many token ids ``s`` records (its length), or None when unknown."""
        known = self._tokens[s]
        return None if known is None else len(known)

    def salt(self, s: int):
        return self._salts[s]

    def owns_token_lists(self) -> bool:
        """No two sequences hold the same token list object (an invariant of copies)."""
        ids = [id(t) for t in self._tokens if t is not None]
        return len(ids) == len(set(ids))

    # --- changes ---------------------------------------------------------------------------
    def take(self, slot: int | None = None) -> int:
        """A free slot (``slot`` itself when given; the caller checked it is free)."""
        if slot is None:
            return self._free.pop()
        self._free.remove(slot)
        return slot

    def take_many(self, n: int) -> list[int]:
        return [self._free.pop() for _ in range(n)]

    def untake(self, slots: list[int]) -> None:
        """Undo :meth:`take_many` (slots not opened): the free list as it was."""
        self._free.extend(reversed(slots))

    def open(self, s: int, tokens: list[int] | None, salt, length: int = 0) -> None:
        """``s`` (taken) becomes live with ``length`` tokens, ``tokens`` copied."""
        self._live[s] = True
        self._tokens[s] = None if tokens is None else list(tokens)
        self._salts[s] = salt
        self.set_length(s, length)

    def close(self, s: int) -> None:
        """``s`` is free again: length 0, nothing known."""
        self._live[s] = False
        self._tokens[s] = self._salts[s] = None
        self.set_length(s, 0)
        self._free.append(s)

    def set_length(self, s: int, length: int) -> None:
        self._lens[s] = length

    def grow(self, s: int, n: int, token_ids: list[int] | None) -> None:
        """Length += n; the ids of the new positions extend the known ones (or, unknown,
        every id is forgotten)."""
        known = self._tokens[s]
        if token_ids is not None and known is not None and len(known) == self._lens[s]:
            known.extend(token_ids)
        else:
            self._tokens[s] = None
        self.set_length(s, self._lens[s] + n)

    def truncate(self, s: int, length: int) -> None:
        if self._tokens[s] is not None:
            del self._tokens[s][length:]
        self.set_length(s, length)

    def move_tokens(self, s: int, start: int, picks: list[int]) -> None:
        """Token ids at ``picks`` move to ``start, start + 1, ...`` (ascending picks, each at or
        after its place: a token tree's accepted path; see ``Beams.compact``)."""
        known = self._tokens[s]
        if known is not None:
            for i, p in enumerate(picks):
                known[start + i] = known[p]

    def set_tokens(self, s: int, tokens: list[int] | None) -> None:
        """Record ``tokens`` (copied) as ``s``'s ids, or forget them (None)."""
        self._tokens[s] = None if tokens is None else list(tokens)

    def copy_from(self, pairs: list[tuple[int, int]]) -> None:
        """Each ``(dst, src)``: dst takes src's length, token ids (a copy) and salt, all read
        before any is written (a permutation is fine)."""
        state = [(d, self._lens[s], self.tokens(s), self._salts[s]) for d, s in pairs]
        for d, length, tokens, salt in state:
            self._tokens[d], self._salts[d] = tokens, salt
            self.set_length(d, length)
