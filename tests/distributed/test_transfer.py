"""Whole-sequence hand-off between two processes (gloo on the CPU): what arrives is
byte-identical, the sender is untouched, and a refused or broken hand-off changes nothing on
either side (tests/handoff_scenarios.py runs the ranks)."""

import os
import pickle

import pytest
import torch
from handoff_scenarios import CASES, KINDS, lost_peer, pair
from ranks import run_ranks

from vmcache.sequences.invariants import check_invariants

CASE_KEYS = [(k, c, p) for k in KINDS for c in CASES for p in (False, True)]


pytestmark = pytest.mark.slow  # end to end: scheduled first (tests/conftest.py)


@pytest.fixture(scope="module")
def pair_results():
    res = run_ranks(pair, 2)
    return res[0], res[1]


@pytest.mark.parametrize("key", CASE_KEYS, ids=lambda k: "-".join(map(str, k)))
def test_handoff_arrives_byte_identical_and_sender_unchanged(pair_results, key):
    sent, got = pair_results[0][key], pair_results[1][key]
    a, b = sent["sent"], got["got"]
    assert a["manifest"] == b["manifest"]  # length, released pages, token ids, salt
    assert a["window_starts"] == b["window_starts"]
    assert len(a["kv"]) == len(b["kv"])
    for x, y in zip(a["kv"], b["kv"]):
        assert x.shape == y.shape and torch.equal(x, y)
    assert got["extra"] == {"req": list(key)}  # JSON: a tuple arrives as a list
    from handoff_scenarios import _same

    assert _same(sent["before"], sent["after"])  # refcounts, tables, K/V: untouched
    assert sent["stats"].data_messages == got["stats"].data_messages == sent["plan"][0]
    assert sent["stats"].data_bytes == got["stats"].data_bytes == sent["plan"][1]


def test_message_counts_follow_the_layout(pair_results):
    sent = pair_results[0]
    n = lambda kind, packed=False: sent[(kind, "plain", packed)]["stats"].data_messages  # noqa: E731
    assert n("vm") == 4  # one per table: 2 layers x K/V, whatever the length
    assert n("vm_token_major") == 2
    assert n("paged") == 2 * 2 * 3  # 45 tokens: 3 blocks of 16, per layer slot and K/V
    assert n("paged", True) == 1  # one gathered copy of the one block table
    assert sent[("vm", "windowed", False)]["stats"].data_messages == 4
    assert (
        sent[("vm", "windowed", False)]["stats"].data_bytes
        < sent[("vm", "plain", False)]["stats"].data_bytes * 70 / 45
    )  # released: not sent


@pytest.mark.parametrize("kind", list(KINDS))
def test_refused_or_aborted_handoff_changes_nothing(pair_results, kind):
    snd, rcv = pair_results[0][(kind, "refusals")], pair_results[1][(kind, "refusals")]
    assert (snd["full"], rcv["full"]) == ("CacheFull", "CacheFull")
    assert (snd["abort"], rcv["abort"]) == ("KeyError", "TransferError")
    assert (snd["mismatch"], rcv["mismatch"]) == ("TransferError", "TransferError")
    for name in ("full", "abort", "mismatch"):
        assert snd[name + "_same"] and rcv[name + "_same"], name


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_a_peer_lost_mid_transfer_leaves_the_other_side_as_it_was(kind, tmp_path, monkeypatch):
    report = tmp_path / "rank1.pkl"
    monkeypatch.setenv("VMCACHE_TEST_REPORT", str(report))
    res = run_ranks(lost_peer, 3, kind)
    assert 0 not in res and 1 not in res  # both died mid-transfer, as injected
    first = pickle.loads(report.read_bytes())  # rank 1, after rank 0 died mid-send
    assert first == {"first": "TransferError", "same": True, "invariants": True}
    assert res[2] == {"result": "TransferError", "same": True, "invariants": True}


@pytest.mark.parametrize("kind", list(KINDS))
def test_wires_pack_and_unpack_into_an_adopted_sequence(kind):
    """One process: a sequence's packed wires unpacked into a sequence another cache adopts
    from its manifest are the same K/V (what a packed hand-off does on each side)."""
    from handoff_scenarios import build, content

    a, s = build(kind, "forked_child", torch.Generator().manual_seed(3))
    b = KINDS[kind]()

    def fill(t):
        for src, dst in zip(a.handoff.runs(s), b.handoff.runs(t)):
            assert src.nbytes == dst.nbytes
            dst.unpack(src.packed().clone())

    t = b.handoff.adopt(a.handoff.manifest(s), fill)
    want, got = content(a, s), content(b, t)
    assert want["manifest"] == got["manifest"]
    assert all(torch.equal(x, y) for x, y in zip(want["kv"], got["kv"]))
    check_invariants(b)

    def broken(t):
        raise RuntimeError("lost mid-way")

    free = b._pool.num_available
    with pytest.raises(RuntimeError, match="lost"):
        b.handoff.adopt(a.handoff.manifest(s), broken)
    assert b._pool.num_available == free and b.sequences == [t]  # all or nothing
    check_invariants(b)


def test_shard_spec_splits_kv_heads_evenly_or_refuses():
    from vmcache import KVSpec
    from vmcache.distributed.tp import shard_spec

    spec = KVSpec(4, 8, 64, torch.bfloat16, num_q_heads=32)
    half = shard_spec(spec, 2)
    assert (half.num_kv_heads, half.q_heads, half.head_dim) == (4, 16, 64)
    assert half.bytes_per_token * 2 == spec.bytes_per_token
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError):
            shard_spec(spec, bad)


def test_a_cuda_cache_over_gloo_is_refused_and_control_follows_the_backend():
    from vmcache.distributed.handoff import control_device

    with pytest.raises(ValueError, match="nccl"):
        control_device(torch.device("cuda", 1), "gloo")
    assert control_device(torch.device("cuda", 1), "nccl") == torch.device("cuda", 1)
    assert control_device(torch.device("cpu"), "gloo") == torch.device("cpu")


def test_ranks_without_a_gpu_each_use_gloo_on_the_cpu():
    from vmcache.distributed.launch import rank_device

    if torch.cuda.device_count():
        pytest.skip("a GPU is visible: test_each_rank_takes_its_own_gpu covers it")
    assert rank_device(0, 2) == ("gloo", None) and rank_device(1, 2) == ("gloo", None)


def test_ranks_on_the_cpu_share_its_cores_out():
    from vmcache.distributed.launch import cpu_threads

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(1) == cores and cpu_threads(2) == max(1, cores // 2)
    assert cpu_threads(cores + 1) == 1  # never none


@pytest.mark.gpu
def test_each_rank_takes_its_own_gpu():
    from vmcache.distributed.launch import rank_device

    n = torch.cuda.device_count()
    backend, device = rank_device(n - 1, n)  # the last local rank of a node of n GPUs
    assert backend == "nccl" and device == torch.device("cuda", n - 1)
    assert torch.cuda.current_device() == n - 1  # set before the group exists
    torch.cuda.set_device(0)
