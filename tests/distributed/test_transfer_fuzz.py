"""A hostile peer against recv_sequence (tests/handoff_fuzz.py runs the ranks): random and
mutated messages at every step of the hand-off. Every trial ends within the deadline with a
TransferError (or CacheFull, or an arrival when a mutation left a valid hand-off: K/V bytes
are opaque), and the receiver is as it was: another sequence's K/V, pages, refcounts, slots
and invariants. Also the wire schema alone: bounds, exact sizes, no pickle anywhere."""

import os
import struct
from collections import Counter

import pytest
from caches import examples
from handoff_fuzz import DEADLINE_S, STEPS, fuzz
from ranks import run_ranks
from repo import ROOT

from vmcache.distributed import wire

TRIALS = examples(90)  # `make test-long`: ten times as many, with a fresh seed


pytestmark = pytest.mark.slow  # end to end: scheduled first (tests/conftest.py)


@pytest.fixture(scope="module")
def ranks():
    seed = int.from_bytes(os.urandom(2), "little") if TRIALS > 90 else 7
    return run_ranks(fuzz, 2, TRIALS, seed, timeout=900)


@pytest.fixture(scope="module")
def report(ranks):
    return ranks[1]


def test_a_receiver_that_runs_out_after_accepting_tells_the_sender(ranks):
    """Finding 10: the sender heard nothing and waited for the group's timeout (30 minutes
    with gloo). Now the receiver replies once its pages are mapped, or that they were not."""
    sender, receiver = ranks[0][-1], ranks[1][-1]
    assert sender["sender"] == "CacheFull" and sender["seconds"] < 10, sender
    assert receiver["outcome"] == "CacheFull" and receiver["same"], receiver


def test_every_hostile_trial_is_refused_in_time_and_changes_nothing(report):
    assert len(report) == TRIALS + 2
    assert report[-2] == {"kind": "vm", "step": "commit lost", "outcome": "TransferError",
                          "why": "commit", "seconds": 0.0, "same": True}  # fmt: skip
    bad = [r for r in report if not r["same"]]
    assert not bad, bad[:3]
    late = [r for r in report if r["seconds"] > DEADLINE_S + 2.0]
    assert not late, late[:3]
    for r in report:
        assert r["outcome"] in ("TransferError", "CacheFull", "arrived"), r
        if r["outcome"] == "arrived":  # only a mutation that left the hand-off valid
            assert r["step"] in (
                "data garbage",
                "data truncated",
                "meta flip",
                "header field",
                "meta field",
            ), r


def test_the_fuzz_reaches_every_step_and_its_refusals(report):
    steps = Counter(r["step"] for r in report)
    assert set(steps) == {*STEPS, "commit lost", "full after accept"}, steps
    whys = " | ".join(r["why"] for r in report)
    for phrase in ("header", "aborted", "manifest this cache refuses", "deadline"):
        assert phrase in whys, phrase
    assert Counter(r["outcome"] for r in report)["TransferError"] >= TRIALS // 2
    print("fuzz:", len(report), "trials;", dict(steps), dict(Counter(r["outcome"] for r in report)))


def test_meta_bounds_and_exact_sizes():
    meta = wire.encode_meta((0,), (1, 2, 3), "s", {"a": [1]})
    assert wire.decode_meta(meta, groups=1, length=3, max_extra_bytes=64) == (
        (0,),
        (1, 2, 3),
        "s",
        {"a": [1]},
    )
    assert len(meta) <= wire.meta_bound(1, 3, 64)
    for bad in (meta[:-1], meta + b"\0", meta[:5]):
        with pytest.raises(wire.WireError):
            wire.decode_meta(bad, groups=1, length=3, max_extra_bytes=64)
    with pytest.raises(wire.WireError, match="max_extra_bytes"):
        wire.decode_meta(meta, groups=1, length=3, max_extra_bytes=4)
    with pytest.raises(wire.WireError, match="groups"):
        wire.decode_meta(meta, groups=2, length=3, max_extra_bytes=64)
    deep = meta[: -len(b'{"a":[1]}') - 4] + struct.pack("<I", 200000) + b"[" * 100000 + \
        b"]" * 100000  # fmt: skip
    with pytest.raises(wire.WireError):
        wire.decode_meta(deep, groups=1, length=3, max_extra_bytes=1 << 20)
    for salt in (None, "é", b"\xff", -12, 2**80):
        m = wire.encode_meta((0,), None, salt, None)
        assert wire.decode_meta(m, groups=1, length=5, max_extra_bytes=4)[2] == salt
    with pytest.raises(TypeError):
        wire.encode_meta((0,), None, ("tuple",), None)
    with pytest.raises((TypeError, ValueError)):
        wire.encode_meta((0,), None, None, {"x": object()})


def test_no_pickle_in_the_library():
    root = ROOT
    for path in root.glob("vmcache/**/*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "pickle.loads" not in text, path
