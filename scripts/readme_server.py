"""Renderers of docs/results.md's server tables (benchmarks/bench_server.py): the load levels
beside ``transformers serve`` and the soak with random disconnects."""

from __future__ import annotations

from readme_format import f, md, newest, source


def _mm(r, k, scale=1.0) -> str:
    return f"{f(r[k] * scale)} ({f(r[k + '_min'] * scale)}–{f(r[k + '_max'] * scale)})"


ORDER = {"vm": 0, "paged": 1, "transformers": 9}  # vLLM's servers between


def load(name, doc) -> str:
    rows = sorted(doc["rows"], key=lambda r: (r["clients"], ORDER.get(r["server"], 5),
                                              r["server"]))  # fmt: skip
    table = md(["clients (requests)", "server", "output tok/s", "TTFT p50 s", "TTFT p99 s",
                "ITL p50 ms", "ITL p99 ms", "tok/s vs vLLM", "TTFT p99 vs vLLM",
                "tok/s vs transformers", "server CPU s", "peak running", "preemptions",
                "cached prompt tok", "answers equal to vm's"],
               [[f"{r['clients']} ({r['requests']})", r["server"], _mm(r, "tok_per_s"),
                 _mm(r, "ttft_p50_s"), _mm(r, "ttft_p99_s"), _mm(r, "itl_p50_s", 1e3),
                 _mm(r, "itl_p99_s", 1e3), r.get("tok_per_s_vs_vllm", "–"),
                 r.get("ttft_p99_vs_vllm", "–"), r.get("tok_per_s_vs_transformers", "–"),
                 r["server_cpu_s"], r.get("peak_running", "–"), r.get("preemptions", "–"),
                 r["cached_tokens"], f"{r['equal_to_vm']} of {r['requests']}"]
                for r in rows])  # fmt: skip
    by = {(r["server"], r["clients"]): r for r in rows}
    levels = sorted({r["clients"] for r in rows})
    verdict = _against_vllm(by, levels) + _against_transformers(by, levels)
    idle = max(r["idle_servers_cpu_s"] for r in rows)
    verdict += (f" The servers not measured were paused (SIGSTOP) and used {f(idle)} CPU s at "
                "most meanwhile.\n\n")  # fmt: skip
    return table + "\n" + verdict + startup(doc) + "\n" + source(name, doc)


def _against_vllm(by, levels) -> str:
    """The issue's goal: the default server at least 1.25x vLLM's output tokens/s at 16 and 64
    clients, its p99 TTFT no worse at every load, answers equal at temperature 0."""
    vm = [by[("vm", c)] for c in levels if "tok_per_s_vs_vllm" in by.get(("vm", c), {})]
    if not vm:
        return ""
    tok = {r["clients"]: r["tok_per_s_vs_vllm"] for r in vm}
    busy = [c for c in (16, 64) if c in tok]
    fast = all(tok[c] >= 1.25 for c in busy) and bool(busy)
    ttft = all(r["ttft_p99_vs_vllm"] <= 1.0 for r in vm)
    equal = all(by[(r["vs_vllm"], r["clients"])]["equal_to_vm"] == r["requests"] for r in vm)
    prompts = all(by[(r["vs_vllm"], r["clients"])]["prompt_tokens_equal_to_vm"] for r in vm)
    word = "MEETS" if fast and ttft and equal and prompts else "MISSES"
    return (f"Verdict against vLLM's server (vmcache-server on VMKVCache with its defaults "
            f"against the faster of vLLM's two bindings at each level): output tokens/s "
            f"{', '.join(f'{f(tok[c])}× at {c}' for c in tok)} client(s) (goal: at least "
            f"1.25× at {' and '.join(map(str, busy)) or '16 and 64'}: "
            f"{'met' if fast else 'missed'}); TTFT p99 "
            f"{', '.join(f(r['ttft_p99_vs_vllm']) + '×' for r in vm)} (goal: at most 1×: "
            f"{'met' if ttft else 'missed'}); answers equal to vLLM's "
            f"{'at every level' if equal else '**not at every level**'}, prompt tokens "
            f"{'equal' if prompts else '**not equal**'}: **{word}** the goal.")  # fmt: skip


def _against_transformers(by, levels) -> str:
    ratios = [by[("vm", c)]["tok_per_s_vs_transformers"] for c in levels
              if "tok_per_s_vs_transformers" in by.get(("vm", c), {})]  # fmt: skip
    if not ratios:
        return ""
    out = (f" Against transformers serve: {', '.join(f(x) + '×' for x in ratios)} its output "
           f"tokens/s at {', '.join(map(str, levels))} clients.")  # fmt: skip
    paged = [by[("paged", c)]["paged_vs_vm_tok_per_s"] for c in levels if ("paged", c) in by]
    if paged:
        out += f" PagedKVCache / VMKVCache tok/s: {', '.join(f(x) for x in paged)}."
    return out


def startup(doc) -> str:
    """Start-up to healthy: first on empty caches, then restarted on what it left; the goals
    for vmcache-server's default (cached at most 15 s, first at most 90 s)."""
    times = doc.get("startup_s") or {}
    if not times:
        return ""
    table = md(["server", "first start s (empty caches)", "restart s (its caches kept)"],
               [[name, t.get("first", t.get("as found")), t.get("cached", "–")]
                for name, t in times.items()])  # fmt: skip
    ours = [t for n, t in times.items() if n in ("vm", "paged") and "cached" in t]
    if not ours:
        return "Start-up to healthy:\n\n" + table
    cached, first = max(t["cached"] for t in ours), max(t["first"] for t in ours)
    word = "MEETS" if cached <= 15 and first <= 90 else "MISSES"
    return ("Start-up to healthy (`/health` answering), each server alone:\n\n" + table +
            f"\nvmcache-server's default: at most {f(first)} s on a first start (goal 90 s), "
            f"{f(cached)} s restarted (goal 15 s): **{word}** the goal.\n")  # fmt: skip


def soak(name, doc) -> str:
    rows = doc.get("soak") or []
    table = md(["cache", "requests (clients)", "wall s", "req/s", "closed mid-stream",
                "answered whole", "ended: stop / length / abort / error", "duplicate ids",
                "pages in use after (prefix-cached)", "sequences / records left",
                "every request ended once", "pages back", "invariants"],
               [[r["cache"], f"{r['requests']} ({r['clients']})", r["wall_s"], r["req_per_s"],
                 r["closed_mid_stream"], f"{r['answered_whole']} of {r['answered']}",
                 f"{r['ended_stop']} / {r['ended_length']} / {r['ended_abort']} / "
                 f"{r['ended_error']}", r["duplicate_ids"],
                 f"{r['pages_used_after']} ({r['prefix_cached_pages']})",
                 f"{r['sequences_after']} / {r['engine_records_after']}",
                 r["every_request_ended_once"], r["pages_back"], r["invariants"]]
                for r in rows])  # fmt: skip
    return table + "\n" + source(name, doc)


BLOCKS = {
    "server-load": lambda: load(*newest("server-20??-*.json")),
    "server-soak": lambda: soak(*newest("server-20??-*.json")),
}
