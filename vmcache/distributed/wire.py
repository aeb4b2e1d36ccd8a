"""The hand-off's metadata on the wire: a fixed binary schema, no pickle. Everything a peer
sends is bounded before anything is allocated and validated field by field after; a message
that breaks any rule is a :class:`WireError` (the receiver turns it into a ``TransferError``).

    meta (little-endian):
      u32 G                    attention groups, then G x u64 firsts (pages released in front)
      u8  has_ids              1: then L x i64 token ids (each >= 0)
      u8  salt tag             0 None | 1 str (UTF-8) | 2 bytes | 3 int (decimal ASCII)
      u32 S, S bytes           the salt's bytes (S <= MAX_SALT_BYTES)
      u32 E, E bytes           ``extra`` as JSON (UTF-8; E <= the receiver's max_extra_bytes)
      nothing after            (the byte count is exact)

The receiver checks the firsts against its own tables (``0 <= f <= keep_page(L, 0)``: no
released page a next step would read, none past the sequence), L against ``max_seq_len`` and
the K/V byte counts against the pages it mapped (:mod:`~vmcache.distributed.handoff`).
"""

from __future__ import annotations

import json
import struct

MAX_SALT_BYTES = 4096
MAX_NOTE_BYTES = 4096  # an abort's reason
_U32, _U64, _U8 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<B")


class WireError(ValueError):
    """A hand-off message that breaks the schema or its bounds."""


def meta_bound(groups: int, length: int, max_extra_bytes: int) -> int:
    """The most bytes a valid meta of ``groups`` groups and ``length`` tokens can have."""
    return 4 + 8 * groups + 1 + 8 * length + 1 + 4 + MAX_SALT_BYTES + 4 + max_extra_bytes


def encode_salt(salt) -> tuple[int, bytes]:
    if salt is None:
        return 0, b""
    if isinstance(salt, str):
        return 1, salt.encode()
    if isinstance(salt, bytes):
        return 2, salt
    if isinstance(salt, int) and not isinstance(salt, bool):
        return 3, str(salt).encode()
    raise TypeError(f"a hand-off carries a salt of None, str, bytes or int, got "
                    f"{type(salt).__name__}")  # fmt: skip


def encode_meta(firsts, token_ids, salt, extra) -> bytes:
    """The meta message (``TypeError`` / ``ValueError`` for a salt or ``extra`` that has no
    encoding: extra must be JSON: dicts with str keys, lists, str, int, float, bool, None)."""
    tag, sb = encode_salt(salt)
    if len(sb) > MAX_SALT_BYTES:
        raise ValueError(f"a salt of {len(sb)} bytes is over {MAX_SALT_BYTES}")
    eb = json.dumps(extra, allow_nan=False, separators=(",", ":")).encode()
    parts = [_U32.pack(len(firsts)), struct.pack(f"<{len(firsts)}Q", *firsts)]
    if token_ids is None:
        parts.append(_U8.pack(0))
    else:
        parts += [_U8.pack(1), struct.pack(f"<{len(token_ids)}q", *token_ids)]
    parts += [_U8.pack(tag), _U32.pack(len(sb)), sb, _U32.pack(len(eb)), eb]
    return b"".join(parts)


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.at = buf, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.buf):
            raise WireError(f"meta ends at byte {len(self.buf)}, a field needs {self.at + n}")
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out

    def u(self, s: struct.Struct) -> int:
        return s.unpack(self.take(s.size))[0]


def decode_meta(buf: bytes, *, groups: int, length: int, max_extra_bytes: int):
    """(firsts, token_ids or None, salt, extra) of a meta message, every field checked
    against the schema and bounds (not yet against the receiver's tables)."""
    r = _Reader(buf)
    g = r.u(_U32)
    if g != groups:
        raise WireError(f"meta has {g} attention groups, this cache {groups}")
    firsts = struct.unpack(f"<{g}Q", r.take(8 * g))
    has_ids = r.u(_U8)
    if has_ids not in (0, 1):
        raise WireError(f"has_ids is {has_ids}")
    ids = None
    if has_ids:
        ids = struct.unpack(f"<{length}q", r.take(8 * length))
        if ids and min(ids) < 0:
            raise WireError("a negative token id")
    tag, n = r.u(_U8), r.u(_U32)
    if n > MAX_SALT_BYTES:
        raise WireError(f"a salt of {n} bytes is over {MAX_SALT_BYTES}")
    raw = r.take(n)
    try:
        salt = _decode_salt(tag, raw)
        n = r.u(_U32)
        if n > max_extra_bytes:
            raise WireError(f"extra of {n} bytes is over max_extra_bytes {max_extra_bytes}")
        extra = json.loads(r.take(n).decode(), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireError(f"meta does not decode: {type(exc).__name__}: {exc}"[:300]) from None
    except ValueError as exc:  # an int past Python's digit limit
        raise WireError(str(exc)[:300]) from None
    if r.at != len(buf):
        raise WireError(f"{len(buf) - r.at} bytes after the meta's last field")
    return firsts, ids, salt, extra


def _decode_salt(tag: int, raw: bytes):
    if tag == 0 and not raw:
        return None
    if tag == 1:
        return raw.decode()
    if tag == 2:
        return raw
    if tag == 3 and raw and raw.lstrip(b"-").isdigit() and raw[:1] != b"+":
        return int(raw)
    raise WireError(f"salt tag {tag} with {len(raw)} bytes")


def _no_constant(name: str):
    raise WireError(f"JSON constant {name} in extra")


def encode_note(text: str) -> bytes:
    """An abort's reason, cut to MAX_NOTE_BYTES."""
    return text.encode(errors="replace")[:MAX_NOTE_BYTES]


def decode_note(raw: bytes) -> str:
    return raw.decode(errors="replace")
