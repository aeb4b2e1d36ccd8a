"""Sequences: the model's K/V shape (``KVSpec``), page tables per attention type, the
coordinator both caches share (slots, lengths, token ids, salts; the core calls), its named
facets (``beams``, ``swap``, ``handoff``, ``elastic``, ``prefix``, ``views``), the invariants,
and ``VMKVCache``.
Built on :mod:`vmcache.memory` and :mod:`vmcache.prefix`."""
