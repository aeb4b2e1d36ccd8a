"""The cache's shape: a small core and named facets (cache.beams, .swap, .handoff, .elastic,
.capacity, .prefix, .views), each in a file that says what of the core it touches; no old
names kept beside them (0.1.0 was never released)."""

import os

import pytest
import torch
from caches import FACTORIES
from repo import ROOT

from vmcache.sequences.invariants import check_invariants

SEQUENCES = os.path.join(ROOT, "vmcache", "sequences")
FACETS = {"beams": "beams.py", "swap": "swap.py", "handoff": "handoff.py",
          "elastic": "elastic.py", "capacity": "capacity.py", "prefix": "prefix.py",
          "views": "views.py"}  # fmt: skip


def filled(kind):
    c = FACTORIES[kind]()
    s = c.new_sequence()
    c.grow(s, 40, token_ids=list(range(40)))
    k = torch.arange(40 * 32, dtype=torch.float32).view(40, 2, 16)
    for layer in range(2):
        c.write(layer, s, 0, k, -k)
    return c, s, k


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_each_facet_is_an_object_of_the_cache_with_its_calls(kind):
    c, s, k = filled(kind)
    for facet, (cls_file) in FACETS.items():
        obj = getattr(c, facet)
        home = "vmcache.paged_fallback." if kind == "paged" and facet == "views" else (
            "vmcache.sequences.")  # fmt: skip
        assert type(obj).__module__ == home + cls_file[:-3], facet
    for old in (
        "assign",
        "truncate",
        "swap_out",
        "swap_in",
        "manifest",
        "adopt_sequence",
        "trim",
        "sleep",
        "wake",
        "reserve",
        "asleep",
        "resident_bytes",
        "pool",
        "max_seqs",
        "page_bytes",
        "k_cache",
        "window_start",
        "kv_scales_for",
        "page_table",
        "pages_for_tokens",
        "mapped_pages",
        "num_free_slots",
        "cache_prefix",
        "cached_prefix_tokens",
        "tier_stats",
        "check_invariants",
        "transfer",
        "memory",
    ):
        assert not hasattr(c, old), old  # on its facet only
    (child,) = c.fork(s)
    c.beams.truncate(child, 20)
    h = c.swap.out(child)
    back = c.swap.restore(h)
    assert torch.equal(c.kv(0, back)[0], k[:20])
    m = c.handoff.manifest(s)
    assert m.length == 40 and c.handoff.can_adopt(m)
    assert c.capacity.mapped_pages(s) == c.capacity.pages_for_tokens(40)
    assert not hasattr(c.elastic, "grow_pages") and not hasattr(c.capacity, "sleep")
    c.elastic.sleep()
    assert c.elastic.asleep and (c.elastic.resident_bytes == 0 or not c.elastic.releases)
    c.elastic.wake()
    assert torch.equal(c.kv(1, s)[1], -k)
    check_invariants(c)
    c.close()


def test_every_facet_file_says_what_it_touches():
    for facet, f in FACETS.items():
        head = open(os.path.join(SEQUENCES, f)).read().split('"""')[1]
        assert "Touches" in head and f"cache.{facet}" in head, f
