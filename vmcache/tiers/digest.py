"""Names of cached pages that hold outside one process: a digest chain over tokens and salt.

The device index keys an entry by its parent *object*; a page demoted to host RAM or disk
outlives that object, so the tiers name it by a digest of everything its K/V depend on:

    root   = H(namespace, cache kind, layout, dtype, heads, head_dim, page bytes, ...)
    d(j)   = H(d(j-1), salt, tokens of page j)          (BLAKE2b, 16 bytes)

Two pages share a digest only with the same model layout, the same tokens before them, the
same tokens in them and the same tenant salt, so a hit in any tier is as exact as a hit on the
device, and salts stay apart in every tier. ``namespace`` names the weights: caches of two
models with equal shapes must not share a tier directory under one namespace.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


def salt_bytes(salt) -> bytes:
    """A salt's stable encoding (the same in every process). ``TypeError`` for a salt that
    has none (only ``None``, ``str``, ``bytes`` and ``int`` have one)."""
    if salt is None:
        return b"N"
    if isinstance(salt, str):
        return b"S" + salt.encode()
    if isinstance(salt, bytes):
        return b"B" + salt
    if isinstance(salt, int) and not isinstance(salt, bool):
        return b"I" + str(salt).encode()
    raise TypeError(
        f"with prefix tiers a salt must be None, str, bytes or int (a stable name across "
        f"processes), got {type(salt).__name__}"
    )


def root_digest(fields: dict) -> bytes:
    """The chain's start for one cache layout: every field a page's bytes depend on."""
    text = repr(sorted((str(k), repr(v)) for k, v in fields.items())).encode()
    return hashlib.blake2b(text, digest_size=DIGEST_BYTES, person=b"vmcache-root").digest()


def page_digest(parent: bytes, salt: bytes, tokens: Sequence[int]) -> bytes:
    """The digest of one full page: its parent's digest, the encoded salt, its token ids."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES, person=b"vmcache-page")
    h.update(len(salt).to_bytes(4, "little") + salt)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def checksum(data) -> bytes:
    """BLAKE2b of a buffer (what a tier file stores beside each entry's bytes)."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()
