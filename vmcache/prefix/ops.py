"""The prefix operations of the coordinator: turning prefix caching (and its tiers) on,
attaching a new sequence's cached prefix, indexing a sequence's pages. Functions of the
coordinator ``c``: they read its lengths, token ids and salts and its one full-attention
group, and map through its transactional core; the :class:`~vmcache.prefix.index.PrefixIndex` owns
its entries, the pool the refcounts. Prefix caching is refused for sliding-window models.
"""

from __future__ import annotations

import math

from vmcache.prefix.index import PrefixIndex


def setup_prefix(c, prefix_caching: bool, prefix_tiers) -> None:
    if not prefix_caching:
        if prefix_tiers is not None:
            raise ValueError("prefix_tiers needs prefix_caching=True")
        return
    if any(g.sliding for g in c._groups):
        raise ValueError(
            "prefix caching is not supported for models with sliding-window layers "
            f"(layers {list(c.spec.sliding_layers)}): a cached prefix would need the "
            "pages those layers release"
        )
    u, P = c._groups[0].u, c._groups[0].P  # a token's and a page's units in one table
    k = math.lcm(P, u) // P  # pages per block: the least run of whole pages ending on a token
    c.prefix = PrefixIndex(c.pool, k * P // u, c._T * k, k)
    c.pool.reclaimer = c.prefix
    if prefix_tiers is not None:
        bind_tiers(c, prefix_tiers)


def attach_prefix(c, s: int, tokens: list[int]) -> None:
    limit = c.max_seq_len // c.prefix.tokens_per_block
    entries = c.prefix.match(tokens, c._seqs.salt(s), max_pages=limit)
    if not entries:
        return
    (g,) = c._groups
    k = c.prefix.pages_per_table
    rows = [[p for e in entries for p in e.pages[i * k : (i + 1) * k]] for i in range(c._T)]
    c._attach_row(s, g.ids, 0, rows)
    c.pool.incref([p for r in rows for p in r])
    n = len(entries) * c.prefix.tokens_per_block
    g.open(s, rows)
    c._seqs.set_tokens(s, tokens[:n])
    c._set_len(s, n)


def close_tiers(c) -> None:
    """The disk tier's directory given up (the cache's close)."""
    if c.prefix is not None and c.prefix.tiers is not None:
        c.prefix.tiers.close()


def bind_tiers(c, tiers) -> None:
    from vmcache.prefix.tiers import PrefixTiers

    if not isinstance(tiers, PrefixTiers):
        raise TypeError(f"prefix_tiers must be a PrefixTiers, got {type(tiers).__name__}")
    ix = c.prefix
    layout = {"cache": type(c).__name__, "spec": repr(c.spec), "tables": c._T,
              "layout": getattr(c, "layout", None), "page_bytes": c.page_bytes,
              "tokens_per_page": ix.tokens_per_block}  # fmt: skip
    if ix.pages_per_table > 1:  # (absent for one page a block: older tier files still match)
        layout["pages_per_table"] = ix.pages_per_table
    ix.root = tiers.bind(layout, ix.pages_per_entry * c.page_bytes)
    ix.tiers, ix.read_pages, ix.write_pages = tiers, c._read_pages, c._write_pages


def tier_stats(c):
    """The prefix tiers' :class:`~vmcache.prefix.tiers.TierStats` (None without tiers)."""
    ix = c.prefix
    return None if ix is None or ix.tiers is None else ix.tiers.stats(ix.pages_per_entry)


def cached_prefix_tokens(c, tokens, salt=None) -> int:
    """How many leading tokens of ``tokens`` a new sequence would find cached under
    ``salt`` now (0 without prefix caching); changes nothing."""
    return 0 if c.prefix is None else c.prefix.peek(list(tokens), salt)


def cache_prefix(c, s: int) -> int:
    """Index sequence ``s``'s full pages of known tokens now (``free`` does it too), so
    requests that arrive while it runs share them; call it once their K/V are written.
    Returns the pages newly indexed (0 without prefix caching or known token ids)."""
    s = c._check_seq(s)
    tokens = c._seqs.tokens(s)
    if c.prefix is None or tokens is None:
        return 0
    n = c._seqs.length(s)
    return c.prefix.insert(tokens[:n], c._groups[0].rows(s), c._seqs.salt(s))
