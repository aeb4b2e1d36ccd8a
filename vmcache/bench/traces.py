"""Request traces for the A/B harness: seeded generators and a CSV reader.

A trace is a list of :class:`TraceRequest` in arrival order. Built-in traces (seeds fixed):

    enterprise   prompts U[500, 1000], completions ~N(200, 50) in [20, 400]   (the seed's)
    long         prompts U[3000, 6000], completions U[200, 600]
    parallel     enterprise with n = 4 samples per request
    beam         enterprise with beam width 4
    shared       2,000-token system prompt shared by every request + U[50, 300] of its own
    multiturn    conversations of 4 turns over a 500-token system prompt: each turn's prompt is
                 the whole conversation so far + a new message U[50, 200]; completions ~150
    heavy        heavy-tailed chat lengths: prompts lognormal (median 400, σ 1.1) in [8, 4096],
                 completions lognormal (median 180, σ 1.0) in [4, 3072] (the shape of public
                 chat traces: most requests short, a long tail to several thousand tokens)

Built-in traces arrive at t = 0 unless given a rate (``with_rate``: Poisson arrivals).

CSV (``--trace FILE``): a header naming ``prompt_len,output_len`` and optionally ``n``,
``arrival_s``; one request per row.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path

from vmcache.bench.latency import poisson_arrivals

L_MAX = 8192


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int
    n: int = 1  # parallel samples sharing the prompt
    beam: int = 1  # beam width (beams share history, reordered every step)
    shared_prefix: int = 0  # leading prompt tokens identical across requests
    arrival_s: float = 0.0
    stream: int = -1  # conversation id: turns of one conversation share their token stream


def token_id(req: TraceRequest, rid: int, pos: int) -> int:
    """The token at position ``pos`` (prompt or generated) of request ``rid``: the shared
    system prompt, then the conversation's (or the request's own) stream."""
    if pos < req.shared_prefix:
        return 1 + (pos * 7919) % 30000
    stream = req.stream if req.stream >= 0 else 1_000_000 + rid
    return 30001 + (stream * 1_000_003 + pos * 7919) % 2_000_000_000


def _enterprise(rng: random.Random) -> tuple[int, int]:
    return rng.randint(500, 1000), min(400, max(20, round(rng.gauss(200, 50))))


def _multiturn(rng: random.Random, convs: int, turns: int = 4) -> list[TraceRequest]:
    by_turn: list[list[TraceRequest]] = [[] for _ in range(turns)]
    for c in range(convs):
        length = 500
        for t in range(turns):
            prompt = length + rng.randint(50, 200)
            out = min(300, max(20, round(rng.gauss(150, 40))))
            by_turn[t].append(TraceRequest(prompt, out, shared_prefix=500, stream=c))
            length = prompt + out
    return [r for turn in by_turn for r in turn]  # every first turn, then every second, ...


def builtin(name: str, num: int, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(f"{name}-{seed}")
    if name == "multiturn":
        return _multiturn(rng, max(1, num // 4))
    out = []
    for _ in range(num):
        if name == "enterprise":
            out.append(TraceRequest(*_enterprise(rng)))
        elif name == "long":
            out.append(TraceRequest(rng.randint(3000, 6000), rng.randint(200, 600)))
        elif name == "parallel":
            out.append(TraceRequest(*_enterprise(rng), n=4))
        elif name == "beam":
            out.append(TraceRequest(*_enterprise(rng), beam=4))
        elif name == "heavy":
            p = min(4096, max(8, round(rng.lognormvariate(math.log(400), 1.1))))
            o = min(3072, max(4, round(rng.lognormvariate(math.log(180), 1.0))))
            out.append(TraceRequest(p, o))
        elif name == "shared":
            p, o = 2000 + rng.randint(50, 300), min(400, max(20, round(rng.gauss(200, 50))))
            out.append(TraceRequest(p, o, shared_prefix=2000))
        else:
            raise ValueError(f"unknown trace {name!r}; expected one of {TRACES}")
    return out


TRACES = ("enterprise", "long", "parallel", "beam", "shared", "multiturn", "heavy")


def with_rate(trace: list[TraceRequest], rate: float, seed: int = 0) -> list[TraceRequest]:
    """The same requests arriving as a Poisson process at ``rate`` requests/s."""
    times = poisson_arrivals(len(trace), rate, seed)
    return [dataclasses.replace(r, arrival_s=t) for r, t in zip(trace, times)]


def read_csv(path: str | Path, l_max: int = L_MAX, skip_long: bool = False):
    """Read a ``prompt_len,output_len[,n][,arrival_s]`` CSV → (requests in arrival order,
    rows skipped). A malformed row raises ``ValueError`` naming the file, the line and what
    was expected; a row longer than ``l_max`` tokens raises too, unless ``skip_long`` (then it
    is counted in the second value)."""
    path = Path(path)
    skipped = 0
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        missing = {"prompt_len", "output_len"} - set(cols)
        if missing:
            raise ValueError(f"{path}:1: header must name prompt_len and output_len "
                             f"(optional n, arrival_s); got {cols}")  # fmt: skip
        out = []
        for row in reader:
            line = reader.line_num
            try:
                p, o = int(row["prompt_len"]), int(row["output_len"])
                n = int(row.get("n") or 1)
                t = float(row.get("arrival_s") or 0.0)
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{line}: expected integers prompt_len, output_len "
                                 f"(and n), a number arrival_s; got {row}") from None  # fmt: skip
            if p < 1 or o < 1 or n < 1 or t < 0:
                raise ValueError(f"{path}:{line}: need prompt_len >= 1, output_len >= 1, "
                                 f"n >= 1, arrival_s >= 0; got {row}")  # fmt: skip
            if p + o > l_max:
                if skip_long:
                    skipped += 1
                    continue
                raise ValueError(f"{path}:{line}: prompt_len + output_len = {p + o} exceeds "
                                 f"--l-max {l_max} (raise it, or --skip-long)")  # fmt: skip
            out.append(TraceRequest(p, o, n=n, arrival_s=t))
    if not out:
        raise ValueError(f"{path}: no requests" + (f" ({skipped} skipped as too long)"
                                                   if skipped else ""))  # fmt: skip
    return sorted(out, key=lambda r: r.arrival_s), skipped  # ties keep file order
