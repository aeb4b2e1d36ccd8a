"""The cache's shape: a small core and named facets (cache.beams, .swap, .transfer, .memory),
each in a file that says what of the coordinator it touches; no old names kept beside them
(0.1.0 was never released)."""

import os

import pytest
import torch
from caches import FACTORIES

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vmcache", "sequences")
FACETS = {"beams": "beams.py", "swap": "swap.py", "transfer": "transfer.py",
          "memory": "memory.py"}  # fmt: skip


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
        assert type(obj).__module__ == "vmcache.sequences." + cls_file[:-3], facet
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
    ):
        assert not hasattr(c, old), old  # on its facet only
    (child,) = c.fork(s)
    c.beams.truncate(child, 20)
    h = c.swap.out(child)
    back = c.swap.restore(h)
    assert torch.equal(c.kv(0, back)[0], k[:20])
    m = c.transfer.manifest(s)
    assert m.length == 40 and c.transfer.can_adopt(m)
    c.memory.sleep()
    assert c.memory.asleep and (c.memory.resident_bytes == 0 or not c.memory.releases)
    c.memory.wake()
    assert torch.equal(c.kv(1, s)[1], -k)
    c.check_invariants()
    c.close()


def test_every_facet_file_says_what_it_touches():
    for facet, f in FACETS.items():
        head = open(os.path.join(ROOT, f)).read().split('"""')[1]
        assert "Touches" in head and f"cache.{facet}" in head, f
