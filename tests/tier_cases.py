"""The prefix-tier tests' helpers: a cache of each kind over given tiers, a prompt written,
indexed and evicted into the tiers, a hit over it checked against its K/V, the disk tier's
files."""

import torch
from prefix_machine import append, kv_of, make

from vmcache.sequences.invariants import check_invariants


def cache(kind, tiers, pages=16, **kw):
    if kind == "vm_token_major":
        return make("vm", pages=pages, layout="token_major", prefix_tiers=tiers, **kw)
    return make(kind, pages=pages, prefix_tiers=tiers, **kw)


def cached(c, tokens, salt=None):
    """Write ``tokens`` as a sequence, free it (its full pages indexed), evict them all."""
    s = c.new_sequence(prefix_tokens=tokens, salt=salt)
    if c.seq_len(s) < len(tokens):
        append(c, s, tokens[c.seq_len(s) :])
    c.free(s)
    c.prefix.index.clear()
    assert c.prefix.index.stats().cached_pages == 0


def hit(c, tokens, salt=None):
    """A new sequence over ``tokens``: how many it found, its K/V checked against them."""
    s = c.new_sequence(prefix_tokens=tokens, salt=salt)
    n = c.seq_len(s)
    for layer in range(2):
        k, v = c.kv(layer, s)
        assert torch.equal(k, kv_of(tokens[:n])) and torch.equal(v, -k)
    c.free(s)
    check_invariants(c)
    return n


def kvt(tmp):
    return sorted(tmp.glob("*.kvt"))
