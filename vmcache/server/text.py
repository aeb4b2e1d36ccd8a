"""Token ids to streamed text: incremental detokenization that never emits half a character,
and stop strings matched on the text (the stop string itself never returned).

    ids:    [p p p p p | g0 g1 g2 ...]       p: the prompt's last tokens, context only
                     ^prefix     ^read
    text of ids[prefix:]  minus  text of ids[prefix:read]  = the new text, emitted only when
    it does not end in U+FFFD (a byte-level token that holds part of a UTF-8 character)

The context tokens make a tokenizer that decodes a word's leading space from its neighbour
(SentencePiece) give the same text streamed as decoded whole.
"""

from __future__ import annotations

CONTEXT_TOKENS = 5  # prompt tokens decoded as context before the first generated one
REPLACEMENT = "\ufffd"


class Detokenizer:
    """One sequence's text, grown by :meth:`push` as its tokens arrive."""

    def __init__(self, tokenizer, prompt: list[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt[-CONTEXT_TOKENS:])  # owned here: context + generated ids
        self._prefix = 0  # ids[prefix:read] were decoded into text already emitted
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int], final: bool = False) -> str:
        """The text ``ids`` add; held back while it would end inside a character, unless
        ``final`` (the sequence ended: whatever is left is emitted)."""
        self._ids.extend(ids)
        if len(self._ids) == self._read:
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) and not final:
            return ""  # nothing printable yet (a special token, or bytes of one character)
        if after.endswith(REPLACEMENT) and not final:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


class StopMatcher:
    """Finds the first stop string in a sequence's text; says how much of the text is safe
    to stream (a suffix that could begin a stop string is held back)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1

    def find(self, text: str, new_from: int) -> int | None:
        """Where the earliest stop string starts in ``text`` (None: none), searching only
        where one could end in text after ``new_from``."""
        lo = max(0, new_from - self._hold)
        hits = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def which(self, text: str, at: int) -> str:
        """The stop string that starts at ``at`` in ``text`` (where :meth:`find` found one;
        the longest when several do)."""
        return max((s for s in self.stops if text.startswith(s, at)), key=len)

    def safe(self, text: str) -> int:
        """How many leading characters of ``text`` no later stop string can cut."""
        return max(0, len(text) - self._hold) if self.stops else len(text)
