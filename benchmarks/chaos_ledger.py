"""Chaos on one KV budget: ``vmcache-server`` processes (a VMKVCache one and a PagedKVCache
one, optionally vLLM's OpenAI server with vmcache underneath) share one ledger under steady
load while faults are injected one after another; after each, the run checks what issue 77
asks of the shared budget:

    every request answered once      no client error, the same greedy tokens for a prompt
                                     every time its server answers it
    every page back                  once idle, no page in use but the prefix cache's
    the ledger = the holders         each vmcache server's row equals its own cache's pages
                                     (its pool's created pages, from its metrics), and the
                                     rows' sum keeps to the total

Faults, in turn: SIGSTOP (past the 5 s lease) and SIGCONT of a server; SIGKILL of a churning
ledger holder (a process that acquires and releases in a loop, so it is often killed inside
a transaction); the ledger truncated, deleted, replaced by a symbolic link (then a file
again); sleep and wake racing requests; a limit lowered (``--preempt``) and raised; with
vLLM, its prefix cache reset.

    python benchmarks/chaos_ledger.py [--minutes 10] [--vllm-python ../.venv-vllm/bin/python]

Writes ``results/chaos-<date>-<machine>.json`` (every fault's checks, the verdict) and prints
its table. ``make bench-chaos`` runs it with vLLM for 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import torch
from common import save, table
from server_load import Proc

from vmcache.memory.ledger_admin import read, set_limit
from vmcache.memory.ledger_rows import LedgerError
from vmcache.models import checkpoint_dir

BUDGET_MIB = 160
FLAGS = ["--max-seq-len", "512", "--max-seqs", "16", "--threads", "1", "--no-compile",
         "--kv-budget-mib", str(BUDGET_MIB)]  # fmt: skip
NEW_TOKENS = 16
SETTLE_S = 20.0  # the longest a check waits for the ledger and the accounts to agree


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(i: int) -> list[int]:
    """A distinct prompt of 40-240 token ids; every fourth shares a 64-token head (prefix hits)."""
    head = [1000 + (j * 37) % 30000 for j in range(64)] if i % 4 == 0 else []
    return head + [2000 + (i * 7919 + j * 31) % 40000 for j in range(40 + (i * 53) % 200)]


class Load:
    """Clients sending completions to every server until stopped; each request's outcome."""

    def __init__(self, servers: dict[str, Proc], clients: int) -> None:
        self.servers, self.clients = servers, clients
        self.outcomes: list[dict] = []
        self.answers: dict[tuple[str, int], str] = {}
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.go = threading.Event()  # cleared: clients send nothing new (a quiet check)
        self.go.set()
        self.in_flight = 0
        self.threads = [threading.Thread(target=self._run, args=(name, c), daemon=True)
                        for name in servers for c in range(clients)]  # fmt: skip

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _run(self, name: str, c: int) -> None:
        srv, n = self.servers[name], 0
        while not self.stop.is_set():
            if not self.go.wait(1.0):
                continue
            i = (c * 1000 + n) % 97  # prompts repeat: the same tokens are expected each time
            n += 1
            with self.lock:
                self.in_flight += 1
            t0 = time.monotonic()
            try:
                out = srv.client.completions.create(
                    model=srv.model, prompt=prompt(i), max_tokens=NEW_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True})  # fmt: skip
                text, tokens, err = out.choices[0].text, out.usage.completion_tokens, None
            except Exception as e:  # noqa: BLE001 - every failure is an outcome to report
                text, tokens, err = None, 0, f"{type(e).__name__}: {e}"[:300]
            with self.lock:
                self.in_flight -= 1
                same = None
                if err is None:
                    same = self.answers.setdefault((name, i), text) == text
                self.outcomes.append({"server": name, "prompt": i, "t0": t0,
                                      "s": time.monotonic() - t0, "tokens": tokens,
                                      "error": err, "same": same})  # fmt: skip


def quiet(load: Load, timeout_s: float = 300.0) -> None:
    """Hold new requests and wait for those in flight to end (the servers go idle)."""
    load.go.clear()
    deadline = time.monotonic() + timeout_s
    while load.in_flight and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # the servers' metrics are at most a second old


def churner(ledger: str) -> subprocess.Popen:
    """A ledger holder that acquires and releases in a tight loop (SIGKILL lands inside its
    transactions)."""
    code = (
        "import sys, time\nfrom vmcache.memory.ledger import SharedBudget\n"
        "b = SharedBudget(sys.argv[1], name='churn', lease_s=5.0, keepalive=True, "
        "lock_timeout_s=2.0)\n"
        "while True:\n    b.acquire(8) and b.release(8)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, ledger], start_new_session=True)


def post(url: str, timeout_s: float = 60.0) -> int:
    req = urllib.request.Request(url, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def accounts(servers: dict[str, Proc], page_bytes: dict[str, int], ledger: str) -> dict:
    """Each vmcache server's own account (its pool's created pages, in ledger units) against
    its ledger row, and the rows' sum against the total."""
    view = read(ledger)
    out = {"total_pages": view.total_pages, "rows_held": view.held_pages, "servers": {}}
    for name, pb in page_bytes.items():  # the vmcache servers (vLLM's account is its own)
        m = servers[name].metrics()
        units = -(-pb // (view.unit_bytes or 4096))
        rows = view.named(name)
        out["servers"][name] = {  # resident: the pool's created pages (its account)
            "own_pages": int(m["vmcache:kv_resident_bytes"]) // pb * units,
            "row_pages": rows[0].held_pages if len(rows) == 1 else None,
            "in_use": int(m["vmcache:kv_pages_used"] - m["vmcache:kv_pages_prefix_idle"]),
        }
    return out


def agree(a: dict, idle: bool) -> bool:
    """The rows equal the accounts within the total; with ``idle``, no page in use either."""
    return a["rows_held"] <= a["total_pages"] and all(
        s["own_pages"] == s["row_pages"] and (not idle or s["in_use"] == 0)
        for s in a["servers"].values()
    )


def settle(servers, page_bytes, ledger, idle: bool = False) -> tuple[bool, float, dict]:
    """Wait until the ledger and the accounts agree; (agreed, seconds, last reading)."""
    t0 = time.monotonic()
    last: dict = {}
    while time.monotonic() - t0 < SETTLE_S:
        try:
            last = accounts(servers, page_bytes, ledger)
            if agree(last, idle):
                return True, time.monotonic() - t0, last
        except (LedgerError, OSError, KeyError, ValueError) as e:
            last = {"error": str(e)[:200]}
        time.sleep(0.25)
    return False, time.monotonic() - t0, last


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=2, help="clients per server")
    p.add_argument("--vllm-python", default=None, help="vLLM's venv python: add its server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="vmcache-chaos-")
    ledger = os.path.join(tmp, "kv.db")
    model = str(checkpoint_dir())
    servers: dict[str, Proc] = {}
    page_bytes: dict[str, int] = {}  # the vmcache servers' page sizes
    try:
        for cache in ("vm", "paged"):
            cmd = [sys.executable, "-m", "vmcache.server", "--model", f"{cache}={model}",
                   "--port", str(free_port()), "--kv-ledger", ledger, "--cache", cache,
                   *FLAGS]  # fmt: skip
            servers[cache] = Proc(cache, cmd, cache)
            with urllib.request.urlopen(servers[cache].url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            page_bytes[cache] = int(text.split('page_bytes="')[1].split('"')[0])
        if args.vllm_python:
            port = free_port()
            vm = {"vmcache": {"ledger": ledger, "name": "vllm", "prefix_cache_mib": 12}}
            cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                   model, "--served-model-name", "vllm", "--dtype", "float32", "--port",
                   str(port), "--max-model-len", "512", "--no-async-scheduling",
                   "--enforce-eager",
                   "--worker-cls", "vmcache.vllm.worker.VmcacheCPUWorker",
                   "--scheduler-cls", "vmcache.vllm.scheduler.VmcacheScheduler",
                   "--additional-config", json.dumps(vm)]  # fmt: skip
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}  # its /reset_*
            servers["vllm"] = Proc("vllm", cmd, "vllm", env=env)
        ok, _, first = settle(servers, page_bytes, ledger)
        print(f"chaos: {len(servers)} servers on {ledger}: {first}", flush=True)
        load = Load(servers, args.clients)
        load.start()
        faults = ["sigstop", "sigkill_holder", "truncate", "delete", "symlink", "sleep_race",
                  "limits"] + (["reset_prefix"] if args.vllm_python else [])  # fmt: skip
        churn = churner(ledger)
        rows, t_end, k = [], time.monotonic() + args.minutes * 60, 0
        while time.monotonic() < t_end:
            fault = faults[k % len(faults)]
            k += 1
            target = rng.choice(sorted(page_bytes))
            t0 = time.monotonic()
            detail = ""
            if fault == "sigstop":
                servers[target].pause()
                time.sleep(8.0)
                servers[target].resume()
            elif fault == "sigkill_holder":
                time.sleep(rng.uniform(0.5, 3.0))
                os.killpg(churn.pid, signal.SIGKILL)
                churn.wait(10)
                churn = churner(ledger)
            elif fault == "truncate":
                size = os.path.getsize(ledger)
                with open(ledger, "r+b") as f:
                    f.truncate(size // 2)
            elif fault == "delete":
                os.unlink(ledger)
            elif fault == "symlink":  # swapped in one rename (holders recreate a missing file)
                link = os.path.join(tmp, "link")
                os.symlink(os.path.join(tmp, "bait.db"), link)
                os.replace(link, ledger)
                time.sleep(3.0)
                os.unlink(ledger)
            elif fault == "sleep_race":
                url = servers[target].url
                detail = f"sleep {post(url + '/sleep?level=1')}"
                time.sleep(rng.uniform(0.0, 2.0))
                detail += f", wake {post(url + '/wake_up')}"
            elif fault == "limits":
                try:
                    floor = read(ledger).named(target)[0].min_pages
                    set_limit(ledger, target, floor, shed=True)
                    time.sleep(4.0)
                    set_limit(ledger, target, BUDGET_MIB * 256)
                    detail = f"{floor * 4096 / 2**20:.1f} MiB (its floor) with --preempt, then all"
                except (ValueError, LedgerError) as e:
                    detail = f"refused: {e}"[:200]
            elif fault == "reset_prefix":
                detail = f"reset {post(servers['vllm'].url + '/reset_prefix_cache')}"
            time.sleep(2.0)  # load runs on through what the fault left
            quiet(load)
            agreed, took, last = settle(servers, page_bytes, ledger, idle=True)
            load.go.set()
            with load.lock:
                errors = [o for o in load.outcomes if o["error"] and o["t0"] >= t0]
            rows.append({"fault": fault, "target": target if fault != "reset_prefix" else "vllm",
                         "detail": detail, "ledger_agrees": agreed,
                         "settle_s": round(took, 2), "errors": len(errors),
                         "first_error": errors[0]["error"] if errors else None,
                         "reading": last})  # fmt: skip
            print(f"chaos: {rows[-1]['fault']:<15} on {rows[-1]['target']:<6} "
                  f"agrees {agreed} in {took:.1f} s, errors {len(errors)} {detail}", flush=True)
        quiet(load)
        load.stop.set()
        for t in load.threads:
            t.join(300)
        os.killpg(churn.pid, signal.SIGKILL)
        churn.wait(10)
        agreed, took, final = settle(servers, page_bytes, ledger, idle=True)
        idle_back = all(s["in_use"] == 0 for s in final.get("servers", {}).values())
    finally:
        for srv in servers.values():
            srv.close()
    outcomes = load.outcomes
    failed = [o for o in outcomes if o["error"]]
    differ = [o for o in outcomes if o["same"] is False]
    verdict = ("PASSES" if not failed and not differ and agreed and idle_back
               and all(r["ledger_agrees"] for r in rows) else "FAILS")  # fmt: skip
    summary = {"minutes": args.minutes, "servers": sorted(servers), "faults": len(rows),
               "requests": len(outcomes), "failed": len(failed), "tokens_differ": len(differ),
               "ledger_agrees_after_every_fault": all(r["ledger_agrees"] for r in rows),
               "final_agrees": agreed, "pages_back_when_idle": idle_back,
               "final": final, "verdict": verdict,
               "first_failures": [o["error"] for o in failed[:5]]}  # fmt: skip
    path = save("chaos", torch.device("cpu"), rows, {"summary": summary},
                out_dir=args.out)  # fmt: skip
    print(table(rows, ["fault", "target", "ledger_agrees", "settle_s", "errors", "detail"]))
    print(json.dumps({k: v for k, v in summary.items() if k != "final"}, indent=1))
    print(f"chaos: {verdict}; {path}")
    return 0 if verdict == "PASSES" else 1


if __name__ == "__main__":
    sys.exit(main())
