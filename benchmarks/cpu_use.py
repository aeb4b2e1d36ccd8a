"""CPU time per thread of a process and its descendants, read from Linux's /proc (standard
library only: vLLM's venv imports it too, beside vllm_anchor.py).

A benchmark takes a :func:`snapshot` before and after a run; :func:`used` turns the two into
what the run cost: the CPU seconds of every thread that ran, and how many threads kept a core
busy for at least a quarter of the wall time. On a 2-core machine that tells a "1-thread"
setting that keeps two cores busy (vLLM's engine loop beside its model) from one that does not.

    /proc/<pid>/task/<tid>/stat    field 2 "(comm)", then utime and stime (fields 14, 15)
                                   in clock ticks, since the thread started
"""

from __future__ import annotations

import os

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
BUSY_SHARE = 0.25  # a thread that ran this share of the wall time or more counts as busy


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return kids


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += _children(p)
        except OSError:  # the process ended meanwhile
            continue
    return out


def snapshot(tree: bool = True) -> dict[str, tuple[str, float]]:
    """{"pid/tid": (thread name, CPU seconds so far)} over this process's threads and, with
    ``tree``, every process below it."""
    snap = {}
    for p in _tree(os.getpid()) if tree else [os.getpid()]:
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on
            snap[f"{p}/{t}"] = (name, (int(fields[11]) + int(fields[12])) * TICK_S)
    return snap


def used(before: dict, after: dict, wall_s: float) -> dict:
    """What a run between two snapshots cost: {"cpu_s": all threads' CPU seconds,
    "busy_threads": how many ran >= BUSY_SHARE of ``wall_s``, "top": the 4 busiest
    [[name, seconds]]} (a thread started during the run counts from zero)."""
    spent = sorted(((name, s - before.get(k, (name, 0.0))[1]) for k, (name, s) in after.items()),
                   key=lambda x: -x[1])  # fmt: skip
    return {"cpu_s": round(sum(s for _, s in spent), 3),
            "busy_threads": sum(1 for _, s in spent if s >= BUSY_SHARE * wall_s),
            "top": [[name, round(s, 3)] for name, s in spent[:4]]}  # fmt: skip
