"""Moving a whole sequence between processes over ``torch.distributed`` (gloo for host caches,
NCCL for CUDA caches): the sender's pages are read in place, the receiver maps fresh pages and
receives into them in place. A VMKVCache table is one contiguous virtual run per sequence, so
a hand-off is one message per table (layer_major: 2·N_L; token_major: 2 per attention type),
whatever the length; a PagedKVCache sends one message per block per layer and K/V (vLLM's
descriptors), or, ``packed=True``, one gathered copy per table.

    sender (send_sequence)                      receiver (recv_sequence)
    header  int64[8] -------------------------> magic, version, status, length, runs, bytes,
                                                meta bytes, layout key: bounded, checked
    meta    uint8[n] -------------------------> firsts, token ids, salt, extra: a fixed binary
                                                schema (vmcache.distributed.wire), no pickle
                                                validated; then the pages mapped
            <------------------------- reply   int64[2]: accepted | full | mismatch | refused
    data    one message per run  -------------> into the freshly mapped pages
            <------------------------- commit  int64[1]: 0 = all arrived

Nothing changes on the sender (it may free the sequence once ``send_sequence`` returns). The
receiver's sequence exists only after every byte arrived: a refusal, a sender abort, a hostile
or lost peer leaves it as it was (pages back in the pool, no slot taken) and raises
:class:`TransferError` (``CacheFull`` when it had no room). The receiver answers only once the
pages are mapped, so a failure on its side after the sender's header (no room after all on a
shared budget, a salt it cannot take, a manifest that breaks its tables) is a reply, never a
silence the sender waits out. Forked and prefix-shared sequences are read through their
shared pages (the sender's refcounts are untouched) and arrive as private pages of one new
sequence.

Trust: the peer is untrusted input. Header fields are bounded before anything is allocated
(the meta's size against what a valid one can be; lengths against ``max_seq_len``), every meta
field is validated (released pages against the receiver's own window rule, byte counts
against the pages it mapped), and ``extra`` is JSON, never code. Every wait has a deadline
(``timeout_s``): past it the hand-off is a ``TransferError`` (with gloo the connection to that
peer is closed then: make a new process group to talk to it again). What this cannot defend:
the transport itself. gloo ends the receiving *process* (``std::terminate``) when a peer sends
a message longer than the receive posted, so a rank of the group can always crash another
(never run code in it, nor write outside the buffers this module posts); a message shorter
than posted leaves zeros. Serve hand-offs only between ranks of one deployment.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vmcache.distributed import wire
from vmcache.errors import CacheFull
from vmcache.sequences.handoff import Manifest

MAGIC = 0x564D4B56  # "VMKV"
VERSION = 2  # 1: pickled metadata (refused)
OK, ABORT = 0, 1  # header status
ACCEPTED, FULL, MISMATCH, REFUSED = 0, 1, 2, 3  # reply status
CONTROL_MESSAGES = 4  # header, meta, reply, commit
TIMEOUT_S = 60.0  # default deadline of one hand-off, every wait included
MAX_EXTRA_BYTES = 1 << 20  # default bound on ``extra`` a receiver accepts
DRAIN_BYTES = 64 << 20  # a mismatched sender's meta is read (then refused) up to this size


class TransferError(RuntimeError):
    """A hand-off that did not happen: refused, aborted by the sender, a message that breaks
    the protocol, a deadline passed, or the peer was lost. Both caches are as they were."""


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
            [list(g) for g in cache.handoff.layout()])  # fmt: skip
    return zlib.crc32(repr(desc).encode())


def _ctrl_device(cache, group) -> torch.device:
    return control_device(cache.config.device, dist.get_backend(group))


def control_device(device: torch.device, backend: str) -> torch.device:
    """Where a hand-off's control messages live for a cache on ``device`` over ``backend``;
    ``ValueError`` for a CUDA cache over a CPU-only backend (gloo's send and recv cannot read
    device memory: the cache's K/V would have to be copied to the host first)."""
    if backend == "nccl":
        return device
    if device.type == "cuda":
        raise ValueError(f"a CUDA cache cannot hand off over a {backend!r} process group "
                         "(point-to-point of CUDA tensors needs NCCL): use 'nccl'")  # fmt: skip
    return torch.device("cpu")


def _buffers(runs, packed: bool) -> list[torch.Tensor]:
    """The messages of a hand-off: every view, or one packed tensor per table."""
    if packed:
        return [r.packed() for r in runs]
    return [v.reshape(-1).view(torch.uint8) for r in runs for v in r.views]


def plan_handoff(cache, s: int, packed: bool = False) -> tuple[int, int]:
    """(data messages, data bytes) sending sequence ``s`` takes; changes nothing."""
    runs = cache.handoff.runs(s)
    n = len(runs) if packed else sum(len(w.views) for w in runs)
    return n, sum(w.nbytes for w in runs)


def send_sequence(cache, s: int, dst: int, group=None, *, packed: bool = False,
                  extra: object = None, timeout_s: float = TIMEOUT_S) -> HandoffStats:  # fmt: skip
    """Send sequence ``s`` of ``cache`` (its K/V, length, token ids, salt, and ``extra``:
    JSON-serializable) to rank ``dst``, which calls :func:`recv_sequence`. Returns once the
    receiver committed; ``s`` is unchanged (free it to complete a move). Raises ``CacheFull``
    when the receiver has no room, :class:`TransferError` for a refusing or mismatched
    receiver, a lost peer or ``timeout_s`` passed; errors preparing the send (a bad ``s``, a
    salt or ``extra`` with no wire encoding) are sent as an abort, then raised."""
    t0 = time.perf_counter()
    deadline = _deadline(timeout_s)
    dev = _ctrl_device(cache, group)
    header = torch.zeros(8, dtype=torch.int64, device=dev)
    try:
        m = cache.handoff.manifest(s)
        runs = cache.handoff.runs(s)
        runs = _buffers(runs, packed)
        meta = wire.encode_meta(m.firsts, m.token_ids, m.salt, extra)
    except BaseException as exc:
        note = wire.encode_note(f"{type(exc).__name__}: {exc}")
        header.copy_(torch.tensor([MAGIC, VERSION, ABORT, 0, 0, 0, len(note), 0]))
        _send(header, dst, group, deadline)
        _send(_byte_tensor(note, dev), dst, group, deadline)
        raise
    nbytes = sum(r.numel() for r in runs)
    header.copy_(torch.tensor([MAGIC, VERSION, OK, m.length, len(runs), nbytes, len(meta),
                               layout_key(cache) | int(packed) << 32]))  # fmt: skip
    _send(header, dst, group, deadline)
    _send(_byte_tensor(meta, dev), dst, group, deadline)
    reply = torch.zeros(2, dtype=torch.int64, device=dev)
    _recv(reply, dst, group, deadline)
    code, value = reply.tolist()
    if code == FULL:
        raise CacheFull(f"rank {dst} has no room for a sequence of {m.length} tokens",
                        wanted=max(0, value), free=0)  # fmt: skip
    if code != ACCEPTED:
        why = {MISMATCH: "its cache's layout or limits differ"}.get(code, "it could not map it")
        raise TransferError(f"rank {dst} refused the sequence: {why}")
    cache.views.synchronize()  # K/V written by kernels still running must be in place
    for r in runs:
        _send(r, dst, group, deadline)
    commit = torch.ones(1, dtype=torch.int64, device=dev)
    _recv(commit, dst, group, deadline)
    if commit[0] != 0:
        raise TransferError(f"rank {dst} did not commit the sequence")
    return HandoffStats(m.length, len(runs), nbytes, time.perf_counter() - t0)


def recv_sequence(cache, src: int, group=None, *, headroom_pages: int = 0,
                  timeout_s: float = TIMEOUT_S,
                  max_extra_bytes: int = MAX_EXTRA_BYTES) -> Arrival:  # fmt: skip
    """Receive a sequence sent by rank ``src`` with :func:`send_sequence` into a new sequence
    of ``cache``; all or nothing (see the module docstring). Refused (``CacheFull`` on both
    sides) unless ``headroom_pages`` stay free after it (room its running sequences need).
    ``timeout_s`` bounds the whole hand-off; ``max_extra_bytes`` the sender's ``extra``."""
    t0 = time.perf_counter()
    deadline = _deadline(timeout_s)
    dev = _ctrl_device(cache, group)
    header = torch.zeros(8, dtype=torch.int64, device=dev)
    _recv(header, src, group, deadline)
    magic, version, status, length, n_runs, nbytes, n_meta, key = header.tolist()
    if magic != MAGIC or version != VERSION:
        raise TransferError(f"rank {src} sent no vmcache hand-off header of version {VERSION} "
                            f"(magic {magic:#x}, version {version})")  # fmt: skip
    if status == ABORT:
        if not 1 <= n_meta <= wire.MAX_NOTE_BYTES:
            raise TransferError(f"rank {src} aborted with a note of {n_meta} bytes")
        note = torch.zeros(n_meta, dtype=torch.uint8, device=dev)
        _recv(note, src, group, deadline)
        raise TransferError(f"rank {src} aborted the hand-off: {wire.decode_note(_bytes(note))}")
    groups = len(cache.handoff.layout())
    fits = status == OK and 0 < length <= cache.config.max_seq_len and key >> 33 == 0
    bound = wire.meta_bound(groups, max(0, length), max_extra_bytes)
    if status != OK or not 1 <= n_meta <= min(bound, DRAIN_BYTES) or min(n_runs, nbytes) < 0:
        raise TransferError(f"rank {src} sent a header out of bounds (status {status}, "
                            f"{length} tokens, meta of {n_meta} bytes)")  # fmt: skip
    raw = torch.zeros(n_meta, dtype=torch.uint8, device=dev)  # a shorter message: zeros
    _recv(raw, src, group, deadline)
    replied = False

    def reply(code: int, value: int = 0) -> None:
        nonlocal replied
        replied = True
        _send(torch.tensor([code, value], dtype=torch.int64, device=dev), src, group, deadline)

    if not fits or key & 0xFFFFFFFF != layout_key(cache):
        reply(MISMATCH)
        raise TransferError(f"rank {src}'s sequence is for another cache layout or longer "
                            f"than max_seq_len {cache.config.max_seq_len}")  # fmt: skip
    packed = bool(key >> 32)
    try:
        m = _manifest(cache, length, _bytes(raw), max_extra_bytes)
    except wire.WireError as exc:
        reply(REFUSED)
        raise TransferError(f"rank {src} sent a manifest this cache refuses: {exc}") from None
    if not cache.handoff.can_adopt(m.manifest, headroom_pages):
        need = cache.handoff.adopt_pages(length, m.manifest.firsts)
        reply(FULL, need)
        raise CacheFull(f"no room for rank {src}'s sequence of {length} tokens",
                        wanted=need, free=cache.capacity.available_pages)  # fmt: skip

    def fill(s: int) -> None:
        runs = cache.handoff.runs(s)
        if packed:
            bufs = [
                torch.zeros(w.nbytes, dtype=torch.uint8, device=cache.config.device) for w in runs
            ]
        else:
            bufs = _buffers(runs, False)
        if len(bufs) != n_runs or sum(b.numel() for b in bufs) != nbytes:
            reply(MISMATCH)
            raise TransferError(f"rank {src} sends {n_runs} runs of {nbytes} bytes; this "
                                f"cache maps {len(bufs)} runs of a different size")  # fmt: skip
        reply(ACCEPTED)
        for b in bufs:
            _recv(b, src, group, deadline)
        if packed:
            for w, b in zip(runs, bufs):
                w.unpack(b)

    try:
        s = cache.handoff.adopt(m.manifest, fill)
    except CacheFull as exc:  # a shared budget gave the pages to another process meanwhile
        if not replied:
            reply(FULL, exc.wanted)
        raise
    except TransferError:
        raise
    except Exception as exc:  # anything else while mapping: the sender hears of it
        if not replied:
            reply(REFUSED)
        raise TransferError(f"rank {src}'s sequence could not be mapped: "
                            f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
    try:
        _send(torch.zeros(1, dtype=torch.int64, device=dev), src, group, deadline)
    except BaseException:
        cache.free(s)  # the sender will not count it as moved: neither side keeps a half
        raise
    return Arrival(s, m.extra, HandoffStats(length, n_runs, nbytes, time.perf_counter() - t0))


@dataclass(frozen=True)
class _Received:
    manifest: Manifest
    extra: object


def _manifest(cache, length: int, raw: bytes, max_extra_bytes: int) -> _Received:
    """The sender's manifest, checked against this cache: released pages within what its own
    window rule may release (never one a next step reads, never past the sequence)."""
    groups = len(cache.handoff.layout())
    firsts, ids, salt, extra = wire.decode_meta(raw, groups=groups, length=length,
                                                max_extra_bytes=max_extra_bytes)  # fmt: skip
    for most, f in zip(cache.handoff.releasable_pages(length), firsts):
        if f > most:
            raise wire.WireError(f"{f} released pages in a group whose window keeps pages "
                                 f"from {most} at {length} tokens")  # fmt: skip
    return _Received(Manifest(length, tuple(firsts), ids, salt), extra)


def _deadline(timeout_s) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    return time.monotonic() + timeout_s


def _wait(work, peer: int, deadline: float, what: str) -> None:
    """Wait for a point-to-point op until ``deadline``: a lost peer or the deadline is a
    :class:`TransferError`."""
    left = deadline - time.monotonic()
    try:
        if left <= 0 or work.wait(timeout=timedelta(seconds=left)) is False:
            raise RuntimeError("timed out")
    except RuntimeError as exc:
        why = "its deadline passed" if time.monotonic() >= deadline - 1e-3 else "peer lost"
        raise TransferError(f"hand-off with rank {peer} failed ({what}, {why}): {exc}") from exc


def _p2p(op, what: str, tensor: torch.Tensor, peer: int, group, deadline: float) -> None:
    try:
        work = op(tensor, peer, group)
    except RuntimeError as exc:
        raise TransferError(f"hand-off with rank {peer} failed ({what}): {exc}") from exc
    _wait(work, peer, deadline, what)


def _send(tensor: torch.Tensor, peer: int, group, deadline: float) -> None:
    _p2p(dist.isend, "send", tensor, peer, group, deadline)


def _recv(tensor: torch.Tensor, peer: int, group, deadline: float) -> None:
    _p2p(dist.irecv, "recv", tensor, peer, group, deadline)


def _byte_tensor(data: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data) or bytearray(1), dtype=torch.uint8)[: len(data)].to(
        device
    )


def _bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()
