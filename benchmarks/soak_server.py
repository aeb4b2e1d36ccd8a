"""The soak of benchmarks/bench_server.py (``--soak N``), in this process, so the cache can be
inspected: N requests from 32 clients to a server of two models on one KV budget (the trained
model served as two names, requests alternating), random lengths, 30 % of the streams closed
after a random number of chunks; it ends when the engine is idle, and checks every page not
held by the prefix index is back in the pool, the cache's invariants, that every request ended
exactly once (answered or aborted, counted by ``/metrics``), and that the engine keeps no
record of any."""

from __future__ import annotations

import concurrent.futures as cf
import random
import time

import openai
from server_load import messages

from vmcache.sequences.invariants import check_invariants

SERVED = "smollm2-135m-instruct"


SOAK_MODELS = ("soak-a", "soak-b")


def soak(n: int, clients: int = 32, seed: int = 0, cache: str = "vm", new: int = 12) -> dict:
    """``n`` requests against a two-model server in this process, random disconnects; then
    each model's engine and cache are inspected on its engine's thread."""
    from vmcache.bench.real import smol
    from vmcache.server.cli import Running, build_server, parse_args

    model, tok = smol()
    args = ["--no-compile", "--cache", cache, "--max-seqs", "32", "--kv-budget-mib", "128",
            "--max-waiting",
            str(2 * n + 64), "--max-seq-len", "1024",
            *(a for m in SOAK_MODELS for a in ("--model", f"{m}={SERVED}"))]  # fmt: skip
    server, _ = build_server(parse_args(args), model, tok)
    loops = [m.loop for m in server.models.values()]
    rng = random.Random(seed)
    plan = [(i, rng.randint(1, new), 2 if rng.random() < 0.1 else 1, rng.random() < 0.7,
             rng.randint(0, 3) if rng.random() < 0.3 else None) for i in range(n)]  # fmt: skip
    t0 = time.perf_counter()
    with Running(server) as running:
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0,
                               timeout=600)  # fmt: skip

        def go(p):
            i, max_tokens, n_, stream, close_after = p
            kw = dict(model=SOAK_MODELS[i % 2], messages=messages(i), max_tokens=max_tokens, n=n_,
                      temperature=0.8, seed=i)  # fmt: skip
            if not stream:
                r = client.chat.completions.create(**kw)
                return r.id, sorted(c.index for c in r.choices if c.finish_reason), False
            s = client.chat.completions.create(**kw, stream=True)
            rid, ends, chunks = None, [], 0
            for ch in s:
                rid = ch.id
                ends += [c.index for c in ch.choices if c.finish_reason]
                chunks += 1
                if close_after is not None and chunks > close_after and len(ends) < n_:
                    s.close()  # the client goes away mid-stream
                    return rid, sorted(ends), True
            return rid, sorted(ends), False

        with cf.ThreadPoolExecutor(clients) as ex:
            res = list(ex.map(go, plan))
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 120
        while any(lp.query(lambda e: e.scheduler.has_work() or bool(e.outputs)) for lp in loops):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)

        def inspect_(e):
            kv = e.kv
            check_invariants(kv)
            return {"pages_used_after": kv.capacity.used_pages,
                    "prefix_cached_pages": kv.prefix.index.stats().cached_pages,
                    "sequences_after": len(kv.sequences), "engine_records_after": len(e.outputs),
                    "swap_bytes_held": kv.swap.held_bytes, "invariants": "held"}  # fmt: skip

        states = [lp.query(inspect_) for lp in loops]
        state = {k: sum(st[k] for st in states) for k in states[0] if k != "invariants"}
        state["invariants"] = "held"
        reg = server.metrics.registry
        ended = {why: sum(int(reg.get_sample_value("vmcache:request_success_total",
                                                   {"finished_reason": why, "model_name": m})
                              or 0) for m in SOAK_MODELS)
                 for why in ("stop", "length", "abort", "error")}  # fmt: skip
    closed = sum(c for _, _, c in res)
    answered = [(rid, ends) for (rid, ends, c), p in zip(res, plan) if not c]
    whole = sum(ends == list(range(p[2])) for (rid, ends, c), p in zip(res, plan) if not c)
    ids = [rid for rid, _, _ in res if rid]
    row = {"cache": cache, "models": len(SOAK_MODELS), "requests": n, "clients": clients,
           "wall_s": wall,
           "req_per_s": n / wall, "closed_mid_stream": closed, "answered": len(answered),
           "answered_whole": whole, "duplicate_ids": len(ids) - len(set(ids)),
           **{f"ended_{k}": v for k, v in ended.items()}, **state}  # fmt: skip
    row["every_request_ended_once"] = sum(ended.values()) == n and whole == len(answered)
    row["pages_back"] = state["pages_used_after"] == state["prefix_cached_pages"]
    return row
