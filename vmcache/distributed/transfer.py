"""Moving a whole sequence between processes over ``torch.distributed`` (gloo for host caches,
NCCL for CUDA caches): the sender's pages are read in place, the receiver maps fresh pages and
receives into them in place. A VMKVCache table is one contiguous virtual run per sequence, so
a hand-off is one message per table (layer_major: 2·N_L; token_major: 2 per attention type),
whatever the length; a PagedKVCache sends one message per block per layer and K/V (vLLM's
descriptors), or, ``packed=True``, one gathered copy per table.

    sender (send_sequence)                      receiver (recv_sequence)
    header  int64[8] -------------------------> length, checks, sizes   (abort: status 1)
    meta    uint8[n] -------------------------> firsts, token ids, salt, extra (pickled)
            <------------------------- reply   int64[2]: accepted | full | mismatch
    data    one message per run  -------------> into freshly mapped pages (adopt_sequence)
            <------------------------- commit  int64[1]: 0 = all arrived

Nothing changes on the sender (it may free the sequence once ``send_sequence`` returns). The
receiver's sequence exists only after every byte arrived: a refusal, a sender abort or a lost
peer leaves it as it was (pages back in the pool, no slot taken) and raises
:class:`TransferError` (``CacheFull`` when it had no room). Forked and prefix-shared
sequences are read through their shared pages (the sender's refcounts are untouched) and
arrive as private pages of one new sequence.

Pickle carries the metadata, as ``torch.distributed``'s object collectives do: the ranks of a
process group trust each other.
"""

from __future__ import annotations

import pickle
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import CacheFull
from ..swap import Manifest

MAGIC = 0x564D4B56  # "VMKV"
OK, ABORT = 0, 1  # header status
ACCEPTED, FULL, MISMATCH = 0, 1, 2  # reply status
CONTROL_MESSAGES = 4  # header, meta, reply, commit


class TransferError(RuntimeError):
    """A hand-off that did not happen: refused, aborted by the sender, or the peer was lost.
    Both caches are as they were before it."""


@dataclass(frozen=True)
class HandoffStats:
    """One hand-off as it went over the wire."""

    tokens: int
    data_messages: int  # K/V messages (control messages: CONTROL_MESSAGES more)
    data_bytes: int
    seconds: float

    @property
    def messages(self) -> int:
        return self.data_messages + CONTROL_MESSAGES


@dataclass(frozen=True)
class Arrival:
    """What :func:`recv_sequence` returns: the new sequence and the sender's ``extra``."""

    slot: int
    extra: object
    stats: HandoffStats


def layout_key(cache) -> int:
    """A checksum of what must match on both sides for bytes to mean the same K/V."""
    unit = getattr(cache, "page_size", None) or getattr(cache, "block_size", None)
    desc = (type(cache).__name__, getattr(cache, "layout", None), repr(cache.spec), unit,
            [(g.ids, g.window, g.u, g.P) for g in cache.groups])  # fmt: skip
    return zlib.crc32(repr(desc).encode())


def _ctrl_device(cache, group) -> torch.device:
    return cache.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _runs(wires, packed: bool) -> list[torch.Tensor]:
    """The messages of a hand-off: every view, or one packed tensor per table."""
    if packed:
        return [w.packed() for w in wires]
    return [v.reshape(-1).view(torch.uint8) for w in wires for v in w.views]


def plan_handoff(cache, s: int, packed: bool = False) -> tuple[int, int]:
    """(data messages, data bytes) sending sequence ``s`` takes; changes nothing."""
    wires = cache.wires(s)
    n = len(wires) if packed else sum(len(w.views) for w in wires)
    return n, sum(w.nbytes for w in wires)


def send_sequence(cache, s: int, dst: int, group=None, *, packed: bool = False,
                  extra: object = None) -> HandoffStats:  # fmt: skip
    """Send sequence ``s`` of ``cache`` (its K/V, length, token ids, salt, and ``extra``, any
    picklable object) to rank ``dst``, which calls :func:`recv_sequence`. Returns once the
    receiver committed; ``s`` is unchanged (free it to complete a move). Raises ``CacheFull``
    when the receiver has no room, :class:`TransferError` for a mismatched receiver or a lost
    peer; errors preparing the send (a bad ``s``) are sent as an abort, then raised."""
    t0 = time.perf_counter()
    dev = _ctrl_device(cache, group)
    header = torch.zeros(8, dtype=torch.int64, device=dev)
    try:
        m = cache.manifest(s)
        wires = cache.wires(s)
        runs = _runs(wires, packed)
        meta = pickle.dumps((m.firsts, m.token_ids, m.salt, extra))
    except BaseException as exc:
        note = pickle.dumps(f"{type(exc).__name__}: {exc}")
        header[:3] = torch.tensor([MAGIC, ABORT, 0])
        header[5] = len(note)
        _guarded(dist.send, header, dst, group)
        _guarded(dist.send, _byte_tensor(note, dev), dst, group)
        raise
    nbytes = sum(r.numel() for r in runs)
    header.copy_(torch.tensor([MAGIC, OK, m.length, len(runs), nbytes, len(meta),
                               layout_key(cache), int(packed)]))  # fmt: skip
    _guarded(dist.send, header, dst, group)
    _guarded(dist.send, _byte_tensor(meta, dev), dst, group)
    reply = torch.zeros(2, dtype=torch.int64, device=dev)
    _guarded(dist.recv, reply, dst, group)
    if reply[0] == FULL:
        raise CacheFull(f"rank {dst} has no room for a sequence of {m.length} tokens",
                        wanted=int(reply[1]), free=0)  # fmt: skip
    if reply[0] != ACCEPTED:
        raise TransferError(f"rank {dst} refused the sequence: its cache's layout differs")
    cache._sync()  # K/V written by kernels still running must be in place
    for r in runs:
        _guarded(dist.send, r, dst, group)
    commit = torch.ones(1, dtype=torch.int64, device=dev)
    _guarded(dist.recv, commit, dst, group)
    if commit[0] != 0:
        raise TransferError(f"rank {dst} did not commit the sequence")
    return HandoffStats(m.length, len(runs), nbytes, time.perf_counter() - t0)


def recv_sequence(cache, src: int, group=None, *, headroom_pages: int = 0) -> Arrival:
    """Receive a sequence sent by rank ``src`` with :func:`send_sequence` into a new sequence
    of ``cache``; all or nothing (see the module docstring). Refused (``CacheFull`` on both
    sides) unless ``headroom_pages`` stay free after it (room its running sequences need)."""
    t0 = time.perf_counter()
    dev = _ctrl_device(cache, group)
    header = torch.zeros(8, dtype=torch.int64, device=dev)
    _guarded(dist.recv, header, src, group)
    magic, status, length, n_runs, nbytes, n_meta, key, packed = header.tolist()
    if magic != MAGIC:
        raise TransferError(f"rank {src} sent no vmcache hand-off header (magic {magic:#x})")
    meta = torch.empty(n_meta, dtype=torch.uint8, device=dev)
    _guarded(dist.recv, meta, src, group)
    if status == ABORT:
        raise TransferError(f"rank {src} aborted the hand-off: {_unpickle(meta)}")
    firsts, ids, salt, extra = _unpickle(meta)
    m = Manifest(length, tuple(firsts), ids, salt)
    reply = torch.tensor([ACCEPTED, 0], dtype=torch.int64, device=dev)
    if key != layout_key(cache) or length > cache.max_seq_len:
        reply[0] = MISMATCH
    elif not cache.can_adopt(m, headroom_pages):
        reply.copy_(torch.tensor([FULL, cache.adopt_pages(length, firsts)]))
    _guarded(dist.send, reply, src, group)
    if reply[0] == FULL:
        raise CacheFull(f"no room for rank {src}'s sequence of {length} tokens",
                        wanted=int(reply[1]), free=cache.pool.num_available)  # fmt: skip
    if reply[0] != ACCEPTED:
        raise TransferError(f"rank {src}'s sequence is for another cache layout or longer "
                            f"than max_seq_len {cache.max_seq_len}")  # fmt: skip

    def fill(s: int) -> None:
        wires = cache.wires(s)
        if packed:
            bufs = [torch.empty(w.nbytes, dtype=torch.uint8, device=cache.device) for w in wires]
        else:
            bufs = _runs(wires, False)
        if len(bufs) != n_runs or sum(b.numel() for b in bufs) != nbytes:
            raise TransferError(f"rank {src} sends {n_runs} runs of {nbytes} bytes; this "
                                f"cache maps {len(bufs)} runs of a different size")  # fmt: skip
        for b in bufs:
            _guarded(dist.recv, b, src, group)
        if packed:
            for w, b in zip(wires, bufs):
                w.unpack(b)

    s = cache.adopt_sequence(m, fill)
    _guarded(dist.send, torch.zeros(1, dtype=torch.int64, device=dev), src, group)
    return Arrival(s, extra, HandoffStats(length, n_runs, nbytes, time.perf_counter() - t0))


def _guarded(op, tensor: torch.Tensor, peer: int, group) -> None:
    """A point-to-point op whose failure (a lost peer) is a :class:`TransferError`."""
    try:
        op(tensor, peer, group)
    except RuntimeError as exc:
        raise TransferError(f"hand-off with rank {peer} failed: {exc}") from exc


def _byte_tensor(data: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _unpickle(t: torch.Tensor):
    return pickle.loads(t.cpu().numpy().tobytes())
