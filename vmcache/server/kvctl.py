"""``vmcache-kv``: read a KV budget's ledger and change a model's limit while it serves.

    vmcache-kv --ledger PATH show [--json]
    vmcache-kv --ledger PATH set-limit NAME MIB [--preempt]
    vmcache-kv --ledger PATH repair

``show`` lists every holder of the ledger (a model of a ``vmcache-server``; dead ones are
reaped first): the KV memory it holds (pages created: resident for a VMKVCache), its floor,
its limit and whether it sleeps. ``set-limit`` sets the most a model may hold: lowered, it gives
pages back as its sequences end (``--preempt``: it preempts sequences until it fits, at its
next check, within a tenth of a second); raised, it may grow again. A limit below the
model's floor is refused. ``repair`` moves a ledger that cannot be read (damaged, or locked by
a stopped process) aside, kept as ``PATH.damaged-...``: the servers that use it register what
they hold in a new file within a second or two (a running server does this itself when it
meets the damage; ``repair`` is for a ledger no server is using). The server prints its
ledger's path at start (``--kv-ledger``).
"""

from __future__ import annotations

import argparse
import json
import sys

from vmcache.memory.ledger_admin import LedgerView, read, repair, set_limit
from vmcache.memory.ledger_rows import LedgerError

MIB = 2**20


def _mib(pages: int, view: LedgerView) -> float:
    return pages * (view.unit_bytes or 0) / MIB


def as_dict(view: LedgerView) -> dict:
    unit = view.unit_bytes or 0
    return {"ledger": view.path, "total_bytes": view.total_pages * unit,
            "held_bytes": view.held_pages * unit,
            "models": [{"name": h.name, "pid": h.pid, "held_bytes": h.held_pages * unit,
                        "floor_bytes": h.min_pages * unit, "limit_bytes": h.max_pages * unit,
                        "is_sleeping": h.asleep, "shedding": h.shed}
                       for h in view.holders]}  # fmt: skip


def table(view: LedgerView) -> str:
    rows = [f"ledger {view.path}: {_mib(view.total_pages, view):.1f} MiB, "
            f"{_mib(view.held_pages, view):.1f} MiB held",
            f"{'model':<24} {'pid':>8} {'held MiB':>9} {'floor MiB':>10} "
            f"{'limit MiB':>10}  state"]  # fmt: skip
    for h in view.holders:
        state = "asleep" if h.asleep else "awake"
        if h.shed and h.held_pages > h.max_pages:
            state += ", preempting to its limit"
        rows.append(f"{h.name or '-':<24} {h.pid:>8} {_mib(h.held_pages, view):>9.1f} "
                    f"{_mib(h.min_pages, view):>10.1f} {_mib(h.max_pages, view):>10.1f}  "
                    f"{state}")  # fmt: skip
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vmcache-kv",
        description="Read a KV budget's ledger and change a model's limit while it serves.",
        epilog="examples: vmcache-kv --ledger kv.db show; vmcache-kv --ledger kv.db set-limit "
        "chat 64 --preempt",
    )
    p.add_argument("--ledger", required=True, help="the ledger file (the server's --kv-ledger)")
    sub = p.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="every model's KV memory, floor, limit and sleep state")
    show.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    lim = sub.add_parser("set-limit", help="the most KV memory a model may hold")
    lim.add_argument("name", help="the model's served name")
    lim.add_argument("mib", type=float, help="its new limit in MiB")
    lim.add_argument("--preempt", action="store_true",
                     help="preempt its sequences until it fits (else pages return as they "
                          "end)")  # fmt: skip
    sub.add_parser("repair", help="move a damaged or stuck ledger aside; its holders rebuild it")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "show":
            view = read(args.ledger)
            print(json.dumps(as_dict(view)) if args.json else table(view))
            return 0
        if args.command == "repair":
            aside = repair(args.ledger)
            print(f"ledger {args.ledger} is readable: nothing to repair" if aside is None else
                  f"ledger {args.ledger} moved aside to {aside}: its live holders register "
                  "what they hold in a new file at the path on their next call")  # fmt: skip
            return 0
        view = read(args.ledger)
        if not view.unit_bytes:
            raise ValueError(f"ledger {args.ledger} records no page size: not a server's")
        if not args.mib >= 0:
            raise ValueError(f"the limit must be >= 0 MiB, got {args.mib}")
        pages = int(args.mib * MIB) // view.unit_bytes
        print(table(set_limit(args.ledger, args.name, pages, shed=args.preempt)))
        return 0
    except (LedgerError, ValueError) as e:
        print(f"vmcache-kv: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
