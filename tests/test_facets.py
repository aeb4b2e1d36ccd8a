"""The cache's shape: a small core and named facets (cache.beams, .swap, .transfer, .memory),
each in a file that says what of the coordinator it touches; the old method names stay one
release as aliases that warn and do what the new call does."""

import os

import pytest
import torch
from caches import FACTORIES

from vmcache.sequences.deprecated import METHODS, PROPERTIES

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
    for old, (facet, new) in {**METHODS, **PROPERTIES}.items():
        assert hasattr(getattr(c, facet), new), (old, facet, new)
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


def _calls(c, s, k):
    """Per old name: the arguments it is called with (built with the new calls)."""
    (child,) = c.fork(s)
    h = c.swap.out(child)
    m = c.transfer.manifest(s)
    return {"assign": ([s], [s]), "truncate": (s, 30), "write_group": (0, [s], 0, k[:1], k[:1]),
            "swap_out": (s,), "swap_in": (h,), "swap_in_pages": (h,), "manifest": (s,),
            "wires": (s,), "can_adopt": (m,), "adopt_pages": (10, (0,)),
            "adopt_sequence": (m, lambda t: None), "export_sequence": (s,),
            "import_sequence": (c.transfer.export(s),), "trim": (),
            "set_memory_limit": (1 << 30,), "sleep": (), "wake": (), "reserve": (s, 8),
            "headroom": (s,), "peak_pages": (100, 8)}  # fmt: skip


@pytest.mark.parametrize("old", sorted(METHODS) + sorted(PROPERTIES))
def test_every_old_name_warns_and_forwards(old):
    c, s, k = filled("vm")
    facet, new = {**METHODS, **PROPERTIES}[old]
    args = _calls(c, s, k)
    if old == "wake":
        c.memory.sleep()
    want = f"cache\\.{old} is deprecated: use cache\\.{facet}\\.{new}"
    with pytest.warns(DeprecationWarning, match=want):
        got = getattr(c, old) if old in PROPERTIES else getattr(c, old)(*args[old])
    if old in PROPERTIES:
        assert got == getattr(getattr(c, facet), new)
    elif old in ("manifest", "headroom", "peak_pages", "adopt_pages", "swap_in_pages"):
        assert got == getattr(getattr(c, facet), new)(*args[old])  # the same answer
    if old == "sleep":
        assert c.memory.asleep
        c.memory.wake()
    c.check_invariants()
    c.close()


def test_every_facet_file_says_what_it_touches():
    for facet, f in FACETS.items():
        head = open(os.path.join(ROOT, f)).read().split('"""')[1]
        assert "Touches" in head and f"cache.{facet}" in head, f
