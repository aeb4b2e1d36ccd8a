"""Prefix hits finer than a block on VMKVCache (32-token blocks on these 4 KiB pages): a
prompt sharing part of a block hits in 16-token units, through a full block's first units or
a published sequence's partial last block (a tail); the page either side writes next is
copied first, so neither sees the other's tokens; a tail gives way to the whole block its
owner later publishes; the paged cache's block is the unit already."""

import torch
from caches import examples, record_coverage, strict_host
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from prefix_machine import PREFIX_COVERAGE, PrefixMachine, append, kv_of, make, tpp

from vmcache import KVSpec, VMKVCache
from vmcache.sequences.invariants import check_invariants

IDS = [(7 * i + 3) % 50 for i in range(200)]


def holds(c, s, ids) -> bool:
    k, v = c.kv(1, s)
    return c.seq_len(s) == len(ids) and torch.equal(k, kv_of(ids)) and torch.equal(v, -k)


def test_the_unit_is_16_tokens_whatever_the_block():
    vm, paged = make("vm"), make("paged")
    assert (tpp(vm), vm.prefix.hit_unit) == (32, 16)
    assert (tpp(paged), paged.prefix.hit_unit) == (16, 16)


def test_a_tail_is_found_in_units_and_copied_on_write_by_both_sides():
    c = make("vm", pages=64)
    P = tpp(c)
    a_ids = IDS[: P + 24]  # a block and a 24-token tail
    a = c.new_sequence(prefix_tokens=a_ids)
    append(c, a, a_ids)
    assert c.prefix.publish(a) > 0
    b_ids = a_ids[: P + 21] + [49] * 5  # shares the block and 21 tokens of the tail
    b = c.new_sequence(prefix_tokens=b_ids)
    assert c.seq_len(b) == P + 16  # the tail's whole unit
    copies = c.stats().cow_copies
    append(c, b, b_ids[P + 16 :])  # into the shared page: copied first
    append(c, a, [1] * 10)  # the owner writes on, into its shared page: copied too
    assert c.stats().cow_copies > copies
    assert holds(c, a, a_ids + [1] * 10) and holds(c, b, b_ids)
    check_invariants(c)
    short = c.new_sequence(prefix_tokens=a_ids[:20] + [48])  # less than a block: its first unit
    assert c.seq_len(short) == 16
    append(c, short, a_ids[16:20] + [48])
    assert holds(c, short, a_ids[:20] + [48])
    for s in (a, b, short):
        c.free(s)
    check_invariants(c)
    assert c.prefix.index.clear() > 0 and c.stats().physical_pages == 0


def three_heads():
    """A cache whose 192-byte rows straddle 4 KiB pages: 64-token blocks of 3 pages a table,
    so a 16-token tail holds the block's first page only, which its owner never writes again."""
    spec = KVSpec(num_layers=2, num_kv_heads=3, head_dim=16, dtype=torch.float32)
    return VMKVCache(spec, 4, 256, page_size=4096, pool_bytes=96 * 4096, backend=strict_host(),
                     own_backend=True, prefix_caching=True)  # fmt: skip


def put(c, s, ids):
    start = c.seq_len(s)
    c.grow(s, len(ids), token_ids=ids)
    k = kv_of(ids, start)[:, :1].expand(len(ids), 3, 16).contiguous()
    for layer in range(2):
        c.write(layer, s, start, k, -k)


def test_a_tail_gives_way_to_its_whole_block_which_hits_as_it_did():
    c = three_heads()
    P = tpp(c)
    assert (P, c.prefix.index.pages_per_table) == (64, 3)
    a = c.new_sequence(prefix_tokens=IDS[:24])
    put(c, a, IDS[:24])
    c.prefix.publish(a)  # a tail over the block's first page (its first unit)
    (tail,) = c.prefix.index._entries.values()
    assert tail.partial
    put(c, a, IDS[24 : P + 8])  # the block filled: its first page is the tail's
    c.prefix.publish(a)
    entries = list(c.prefix.index._entries.values())
    assert tail not in entries and not any(e.partial for e in entries[:1])
    check_invariants(c)  # no page in two entries
    b = c.new_sequence(prefix_tokens=IDS[:21] + [49])
    assert c.seq_len(b) == 16  # the whole block's first unit finds what the tail found
    put(c, b, IDS[16:21] + [49])
    k, _ = c.kv(1, b)
    assert torch.equal(k[:, 0], kv_of(IDS[:21] + [49])[:, 0])
    k, _ = c.kv(1, a)
    assert torch.equal(k[:, 0], kv_of(IDS[: P + 8])[:, 0])
    check_invariants(c)


def test_tails_are_evicted_like_blocks_and_never_while_mapped():
    c = make("vm", pages=24)
    P = tpp(c)
    for i in range(4):  # four prompts of one block less one unit: tails only, then freed
        ids = [i] * (P - 16)
        s = c.new_sequence(prefix_tokens=ids)
        append(c, s, ids)
        c.free(s)  # publishes its tail
    index = c.prefix.index
    assert all(e.partial for e in index._entries.values()) and index.reclaimable() > 0
    keep = c.new_sequence(prefix_tokens=[3] * (P - 16) + [9])
    assert c.seq_len(keep) == P - 16
    mapped = {p for t in c.views.page_table(keep) for p in t}
    index.reclaim(10**6)
    assert mapped <= set(index.references())  # the one it maps stays
    check_invariants(c)


class UnitsMachine(PrefixMachine):
    """The prefix state machine (K/V a function of token and position, every sequence's
    contents checked after each step) with prompts whose tails are often the start of a page
    pattern, so hits on part of a block (tails, a block's first units) happen."""

    kind = "vm"
    pattern_tails = True
    coverage = "vm_units"


def test_the_units_machine_really_hits_part_of_a_block():
    PREFIX_COVERAGE.pop("vm_units", None)
    run_state_machine_as_test(UnitsMachine, settings=settings(
        max_examples=30, stateful_step_count=30, deadline=None, derandomize=True,
        database=None))  # fmt: skip
    seen = PREFIX_COVERAGE["vm_units"]
    assert seen["unit hits"] >= 1 and seen["hits"] >= 10, seen
    record_coverage("prefix machine vm (16-token units)", seen)


TestUnitsMachine = UnitsMachine.TestCase
TestUnitsMachine.settings = settings(max_examples=examples(30), stateful_step_count=30,
                                     deadline=None)  # fmt: skip
