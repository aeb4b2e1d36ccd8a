"""The models one server serves, built from its flags: each its own engine and cache, all of
them drawing on one KV budget when the server has one.

    vmcache-server --model chat=smollm2-135m-instruct --model code=/ckpt/coder \\
                   --kv-budget-mib 512 [--kv-ledger /run/kv.db] [--kv-floor-mib code=64]

One budget, in 4 KiB units, kept in a ledger (:class:`~vmcache.memory.ledger.SharedBudget`):
the file ``--kv-ledger`` names, which servers in other processes may open too (the first sets
the size; a later one naming another size is refused), or a private temporary one. Each model
is a holder of it, by its name:
  floor    its guaranteed minimum: what one sequence of ``--max-seq-len`` needs, unless
           ``--kv-floor-mib NAME=MIB`` says otherwise (the floors must fit in the budget)
  limit    at most the whole budget (a model alone may use all of it); ``vmcache-kv
           set-limit`` changes it while it serves
  share    under contention the ledger's fair share: max(floor, budget / models that hold
           or want pages); free pages are given back after each step beyond one chunk, and
           idle prefix pages and free pages as soon as another holder wants pages
A VMKVCache maps pages into its reserved range as they are granted (memory follows the
budget); a PagedKVCache counts its blocks against it but allocates its block tensor whole.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vmcache.memory.ledger import (  # (UNIT_BYTES: one ledger page)
    SERVING_LEASE_S,
    SERVING_LOCK_TIMEOUT_S,
    UNIT_BYTES,
    SharedBudget,
)
from vmcache.memory.ledger_rows import check_ledger_path

CHUNK_PAGES = 16  # cache pages taken from the budget at a time (and kept free after a step)


@dataclass(frozen=True)
class ModelEntry:
    name: str  # what requests send as 'model'
    source: str  # an embedded name, a checkpoint directory or a .gguf file


def model_entries(values: list[str], served_name: str | None) -> list[ModelEntry]:
    """``--model`` values (``NAME=SOURCE`` or ``SOURCE``) as entries; ``ValueError`` for a
    repeated name or ``--served-model-name`` beside several models."""
    out = []
    for v in values:
        name, sep, source = v.partition("=")
        if not sep:
            name, source = Path(v).name, v
        if not name or not source:
            raise ValueError(f"--model {v!r}: give NAME=SOURCE or SOURCE")
        out.append(ModelEntry(name, source))
    if served_name is not None:
        if len(out) != 1:
            raise ValueError("--served-model-name names a single model; name several with "
                             "--model NAME=SOURCE")  # fmt: skip
        out[0] = ModelEntry(served_name, out[0].source)
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--model names must be distinct, got {names}")
    return out


def sizes_mib(values: list[str], names: list[str], flag: str) -> dict[str, float]:
    """``NAME=MIB`` values for known model names."""
    out = {}
    for v in values:
        name, sep, mib = v.partition("=")
        if not sep or name not in names:
            raise ValueError(f"{flag} {v!r}: give NAME=MIB for one of {names}")
        try:
            out[name] = float(mib)
        except ValueError:
            raise ValueError(f"{flag} {v!r}: {mib!r} is not a number of MiB") from None
        if out[name] < 0:
            raise ValueError(f"{flag} {v!r}: must be >= 0")
    return out


class Ledger:
    """The server's ledger: the path given, or a private temporary file (removed on close)."""

    def __init__(self, path: str | None) -> None:
        self._tmp = None
        if path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="vmcache-kv-")  # mode 0700
            path = os.path.join(self._tmp.name, "ledger.db")
        else:
            check_ledger_path(path)
        self.path = path

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def budget_for(ledger: Ledger, name: str, total_units: int):
    """Model ``name``'s holder of the ledger (floor 0 until its cache exists), on a lease its
    own thread keeps: a server stopped (SIGSTOP) loses its pages within the lease (one whose
    threads run keeps them), and no call waits on another process's transaction longer than
    the lock bound."""
    return SharedBudget(
        ledger.path,
        total_units,
        name=name,
        unit_bytes=UNIT_BYTES,
        lease_s=SERVING_LEASE_S,
        keepalive=True,
        lock_timeout_s=SERVING_LOCK_TIMEOUT_S,
    )


def set_floor(budget, units_per_page: int, kv, floor_mib: float | None,
              max_seq_len: int) -> int:  # fmt: skip
    """Promise model's floor on the ledger: ``floor_mib``, or one ``max_seq_len`` sequence's
    pages (``units_per_page`` ledger units each: its cache's ScaledBudget's); returns it in
    ledger units. ``ValueError`` when the floors exceed the budget."""
    if floor_mib is None:
        floor = kv.capacity.pages_for_tokens(max_seq_len) * units_per_page
    else:
        floor = -(-int(floor_mib * 2**20) // UNIT_BYTES)
    try:
        budget.set_limits(min_pages=floor)
    except ValueError as e:
        raise ValueError(f"model {budget.name!r}: its floor of {floor * UNIT_BYTES / 2**20:.1f} "
                         f"MiB does not fit the KV budget beside the others' ({e}); raise "
                         "--kv-budget-mib or lower --kv-floor-mib") from None  # fmt: skip
    return floor
