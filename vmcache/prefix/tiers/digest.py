"""Names of cached pages that hold outside one process: a digest chain over tokens and salt.

The device index keys an entry by its parent *object*; a page demoted to host RAM or disk
outlives that object, so the tiers name it by a digest of everything its K/V depend on:

    root   = MAC_key(namespace, cache kind, layout, dtype, heads, head_dim, page bytes, ...)
    d(j)   = H(d(j-1), salt, tokens of page j)          (BLAKE2b, 16 bytes)

Two pages share a digest only with the same model layout, the same tokens before them, the
same tokens in them and the same tenant salt, so a hit in any tier is as exact as a hit on the
device, and salts stay apart in every tier. ``namespace`` names the weights: caches of two
models with equal shapes must not share a tier directory under one namespace.

The root is keyed (the tiers' secret key), so without the key no digest can be computed: a
stored digest does not confirm a guessed prompt, and :func:`mac` (keyed too) makes a tier file
that passes its checks impossible to forge. Files name their root only by :func:`root_tag`.
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


def root_digest(fields: dict, key: bytes) -> bytes:
    """The chain's start for one cache layout (every field a page's bytes depend on), keyed."""
    text = repr(sorted((str(k), repr(v)) for k, v in fields.items())).encode()
    return hashlib.blake2b(text, digest_size=DIGEST_BYTES, key=key,
                           person=b"vmcache-root").digest()  # fmt: skip


def root_tag(root: bytes) -> bytes:
    """What a file stores to say which root it belongs to (one-way: not the root itself)."""
    return hashlib.blake2b(root, digest_size=DIGEST_BYTES, person=b"vmcache-rtag").digest()


def mac_key(key: bytes) -> bytes:
    """The key :func:`mac` uses, derived from the tiers' key (never the key itself)."""
    return hashlib.blake2b(key, digest_size=32, person=b"vmcache-mac").digest()


def mac(key: bytes, *parts) -> bytes:
    """Keyed BLAKE2b of ``parts`` (buffers) in order: a tier file's integrity tag."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, key=key, person=b"vmcache-file")
    for part in parts:
        h.update(part)
    return h.digest()


def page_digest(parent: bytes, salt: bytes, tokens: Sequence[int]) -> bytes:
    """The digest of one full page: its parent's digest, the encoded salt, its token ids."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES, person=b"vmcache-page")
    h.update(len(salt).to_bytes(4, "little") + salt)
    h.update(array("q", tokens).tobytes())
    return h.digest()
