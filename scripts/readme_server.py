"""Renderers of docs/results.md's server tables (benchmarks/bench_server.py): the load levels
beside ``transformers serve`` and the soak with random disconnects."""

from __future__ import annotations

from readme_format import f, md, newest, source


def _mm(r, k, scale=1.0) -> str:
    return f"{f(r[k] * scale)} ({f(r[k + '_min'] * scale)}–{f(r[k + '_max'] * scale)})"


def load(name, doc) -> str:
    rows = sorted(doc["rows"], key=lambda r: (r["clients"], r["server"] != "vm",
                                              r["server"] == "transformers"))  # fmt: skip
    table = md(["clients (requests)", "server", "req/s", "output tok/s", "TTFT p50 s",
                "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms", "tok/s vs transformers",
                "server CPU s", "peak pages (of)", "peak running", "preemptions",
                "cached prompt tok", "answers equal to vm's"],
               [[f"{r['clients']} ({r['requests']})", r["server"], _mm(r, "req_per_s"),
                 _mm(r, "tok_per_s"), _mm(r, "ttft_p50_s"), _mm(r, "ttft_p99_s"),
                 _mm(r, "tpot_p50_s", 1e3), _mm(r, "tpot_p99_s", 1e3),
                 r.get("tok_per_s_vs_transformers", "–"), r["server_cpu_s"],
                 f"{r['peak_pages']} ({r['pages_total']})" if "peak_pages" in r else "–",
                 r.get("peak_running", "–"), r.get("preemptions", "–"), r["cached_tokens"],
                 f"{r['equal_to_vm']} of {r['requests']}"] for r in rows])  # fmt: skip
    ratios = [r["tok_per_s_vs_transformers"] for r in rows if r["server"] == "vm"
              and "tok_per_s_vs_transformers" in r]  # fmt: skip
    by = {(r["server"], r["clients"]): r for r in rows}
    levels = sorted({r["clients"] for r in rows})
    verdict = ""
    if ratios:
        faster = [c for c in levels if by.get(("vm", c), {}).get("tok_per_s_vs_transformers",
                                                                 0) > 1.0]  # fmt: skip
        slower = [c for c in levels if c not in faster]
        word = ("FASTER at every level" if not slower else
                "SLOWER at every level" if not faster else
                f"FASTER at {', '.join(map(str, faster))} clients, SLOWER at "
                f"{', '.join(map(str, slower))}")  # fmt: skip
        verdict = (f"Verdict (output tokens/s, vmcache-server on VMKVCache against transformers "
                   f"serve): {word} ({', '.join(f(x) + '×' for x in ratios)} at "
                   f"{', '.join(map(str, levels))} clients).")  # fmt: skip
        paged = [by[("paged", c)]["paged_vs_vm_tok_per_s"] for c in levels
                 if ("paged", c) in by]  # fmt: skip
        if paged:
            verdict += (f" PagedKVCache / VMKVCache tok/s: "
                        f"{', '.join(f(x) for x in paged)}.")  # fmt: skip
        ttft = [(c, by[("vm", c)]["ttft_p50_s"] / by[("paged", c)]["ttft_p50_s"]) for c in levels
                if ("vm", c) in by and ("paged", c) in by]  # fmt: skip
        if ttft:
            top, ratio = ttft[-1]
            verdict += (f" TTFT p50, VMKVCache / PagedKVCache: "
                        f"{', '.join(f(x) + '×' for _, x in ttft)}; at {top} clients "
                        f"{f(ratio)}× ({'HOLDS' if ratio <= 1.1 else 'MISSED'} the goal of "
                        "at most 1.1×).")  # fmt: skip
        idle = max(r["idle_servers_cpu_s"] for r in rows)
        verdict += (f" The idle servers used at most {f(idle)} CPU s while another ran"
                    " (interference).\n\n")  # fmt: skip
    return table + "\n" + verdict + source(name, doc)


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
