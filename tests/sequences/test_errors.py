"""Bad input against both caches: a clear typed error, and the state exactly as it was."""

import caches
import pytest
import torch

from vmcache import CacheFull
from vmcache.sequences.invariants import check_invariants


@pytest.fixture(params=sorted(caches.FACTORIES))
def cache(request):
    c = caches.FACTORIES[request.param]()
    yield c
    c.close()


def state(c):
    return (
        c.stats(),
        {s: (c.seq_len(s), c.views.page_table(s)) for s in c.sequences},
        {s: [torch.cat(c.kv(layer, s)).clone() for layer in range(2)] for s in c.sequences},
    )


def kv(n, dtype=torch.float32, heads=2, dim=16, device="cpu"):
    return torch.randn(n, heads, dim, dtype=dtype, device=device)


BAD_CALLS = [
    ("grow unknown seq", lambda c, s: c.grow(99, 1), KeyError),
    ("grow non-int seq", lambda c, s: c.grow("a", 1), TypeError),
    ("grow n<0", lambda c, s: c.grow(s, -1), ValueError),
    ("grow float n", lambda c, s: c.grow(s, 1.0), TypeError),
    ("grow past max_seq_len", lambda c, s: c.grow(s, 1000), ValueError),
    (
        "write wrong shape",
        lambda c, s: c.write(0, s, 0, kv(2, heads=3), kv(2, heads=3)),
        ValueError,
    ),
    (
        "write wrong dtype",
        lambda c, s: c.write(0, s, 0, kv(2, torch.float16), kv(2, torch.float16)),
        TypeError,
    ),
    (
        "write wrong device",
        lambda c, s: c.write(0, s, 0, kv(2, device="meta"), kv(2, device="meta")),
        ValueError,
    ),
    ("write beyond length", lambda c, s: c.write(0, s, 19, kv(2), kv(2)), ValueError),
    ("write negative start", lambda c, s: c.write(0, s, -1, kv(2), kv(2)), ValueError),
    ("write k/v mismatch", lambda c, s: c.write(0, s, 0, kv(2), kv(3)), ValueError),
    ("write not a tensor", lambda c, s: c.write(0, s, 0, [1], [1]), TypeError),
    ("write bad layer", lambda c, s: c.write(5, s, 0, kv(1), kv(1)), ValueError),
    ("kv bad layer", lambda c, s: c.kv(-1, s), ValueError),
    ("fork n<1", lambda c, s: c.fork(s, 0), ValueError),
    ("fork too many", lambda c, s: c.fork(s, 50), CacheFull),
    ("free unknown", lambda c, s: c.free(7), KeyError),
    ("swap_in not a handle", lambda c, s: c.swap.restore("h"), TypeError),
    ("pool exhausted", lambda c, s: [c.grow(c.new_sequence(), 250) for _ in range(8)], CacheFull),
]


@pytest.mark.parametrize("name,call,exc", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input_typed_error_state_unchanged(cache, name, call, exc):
    s = cache.new_sequence()
    cache.grow(s, 20)
    for layer in range(2):
        cache.write(layer, s, 0, kv(20), kv(20))
    cache.fork(s, 1)
    live = set(cache.sequences)
    before = state(cache)
    with pytest.raises(exc):
        call(cache, s)
    for extra in set(cache.sequences) - live:  # sequences the failing call made on purpose
        cache.free(extra)
    after = state(cache)
    assert before[0] == after[0] and before[1] == after[1]
    for x in before[2]:
        assert all(torch.equal(a, b) for a, b in zip(before[2][x], after[2][x]))
    check_invariants(cache)


def test_freed_sequence_and_double_free(cache):
    s = cache.new_sequence()
    cache.grow(s, 3)
    cache.free(s)
    for call in (lambda: cache.free(s), lambda: cache.grow(s, 1), lambda: cache.kv(0, s),
                 lambda: cache.fork(s, 1), lambda: cache.swap.out(s)):  # fmt: skip
        with pytest.raises(KeyError, match="not live"):
            call()


def test_swap_handle_from_another_cache_rejected(cache):
    other = caches.paged()
    s = other.new_sequence()
    other.grow(s, 2)
    h = other.swap.out(s)
    with pytest.raises(ValueError, match="another cache"):
        cache.swap.restore(h)
