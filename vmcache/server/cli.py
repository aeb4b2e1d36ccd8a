"""``python -m vmcache.server`` / ``vmcache-server``: an OpenAI-compatible server over the
engine, on the embedded SmolLM2-135M-Instruct by default, bound to loopback.

    vmcache-server                                    # http://127.0.0.1:8000/v1
    vmcache-server --cache paged --kv-dtype fp8 --pool-mib 512 --max-seqs 64
    vmcache-server --model /path/to/checkpoint --host 0.0.0.0 --api-key-file key.txt
    vmcache-server --model a=smollm2-135m-instruct --model b=/ckpt --kv-budget-mib 256

Prefix caching is on (``--no-prefix-caching`` turns it off); ``--speculative`` drafts by
prompt lookup. The settings chosen are printed at start.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import sys
import threading
import time
from pathlib import Path

import torch

KV_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "fp8": torch.float8_e4m3fn,
             "int8": torch.int8}  # fmt: skip
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    from vmcache.models import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="vmcache-server", description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]SOURCE",
                   help="an embedded name, a checkpoint directory or a .gguf file, served as "
                        "NAME (default: its name); give it again to serve several models "
                        f"(default: {DEFAULT_MODEL})")  # fmt: skip
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients send as 'model' (default: --model's name)",
    )
    p.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--cache", choices=("vm", "paged"), default="vm")
    p.add_argument(
        "--dtype",
        choices=tuple(MODEL_DTYPES),
        default="float32",
        help="the model's weights and activations",
    )
    p.add_argument(
        "--kv-dtype",
        choices=tuple(KV_DTYPES),
        default="auto",
        help="K/V storage (auto: the model's dtype; int8: per-token scales)",
    )
    p.add_argument("--pool-mib", type=_positive(float), default=256.0, help="KV pool size in MiB")
    p.add_argument("--max-seqs", type=_positive(int), default=128,
                   help="sequences running at once (vLLM's server's default on a CPU)")  # fmt: skip
    p.add_argument(
        "--max-seq-len",
        type=_positive(int),
        default=2048,
        help="prompt + completion tokens of one sequence",
    )
    p.add_argument("--max-batch-tokens", type=_positive(int), default=2048)
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="sequences that may wait beyond --max-seqs (then 429)",
    )
    p.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    p.add_argument("--no-prefix-caching", action="store_true")
    step = p.add_mutually_exclusive_group()
    step.add_argument(
        "--compile",
        dest="compile",
        action="store_const",
        const="on",
        default="auto",
        help="the compiled engine step, refusing to start where it cannot run (default: "
        "compiled where the model and this machine allow, the eager step otherwise)",
    )
    step.add_argument("--no-compile", dest="compile", action="store_const", const="off",
                      help="the eager engine step (nothing compiled)")  # fmt: skip
    p.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="where the compiled step is kept (created private; default "
        "~/.cache/vmcache/compiled): a first start on a model compiles it there, later ones "
        "load it in seconds",
    )
    p.add_argument(
        "--speculative",
        action="store_true",
        help="prompt-lookup drafts (k=4), verified in the next step",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="a file holding the bearer token clients must send (read once)",
    )
    p.add_argument("--api-key", default=None,
                   help="the bearer token itself (visible in the process list: prefer "
                        "--api-key-file)")  # fmt: skip
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins allowed to call the API (CORS); "
                        "none by default, '*' only if named")  # fmt: skip
    p.add_argument("--request-timeout-s", type=_positive(float), default=600.0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    kv = p.add_argument_group("one KV budget for every model (several models, or any of these)")
    kv.add_argument("--kv-budget-mib", type=_positive(float), default=None,
                    help="the KV memory every model draws on (default: --pool-mib); a model "
                         "alone may use all of it")  # fmt: skip
    kv.add_argument("--kv-ledger", metavar="PATH", default=None,
                    help="the budget's ledger file: servers naming the same file share one "
                         "budget (the first sets its size); default: a private temporary "
                         "one")  # fmt: skip
    kv.add_argument("--kv-floor-mib", action="append", default=[], metavar="NAME=MIB",
                    help="a model's guaranteed KV memory (default: one --max-seq-len "
                         "sequence's)")  # fmt: skip
    kv.add_argument("--sleep-after-s", type=_positive(float), default=None,
                    help="a model idle this long sleeps: its KV pages (and floor) given back, "
                         "its next request wakes it")  # fmt: skip
    kv.add_argument("--sleep-level", type=int, choices=(1, 2), default=1,
                    help="1: KV memory only; 2: the weights too, loaded again on wake "
                         "(eager engines)")  # fmt: skip
    args = p.parse_args(argv)
    from vmcache.server.fleet import model_entries, sizes_mib

    try:
        args.models = model_entries(args.model or [DEFAULT_MODEL], args.served_model_name)
        names = [e.name for e in args.models]
        args.floors = sizes_mib(args.kv_floor_mib, names, "--kv-floor-mib")
    except ValueError as e:
        p.error(str(e))
    args.model = args.models[0].source
    args.shared = (len(args.models) > 1 or args.kv_budget_mib is not None
                   or args.kv_ledger is not None or bool(args.floors))  # fmt: skip
    if args.max_waiting < 0:
        p.error("--max-waiting must be >= 0")
    if args.compile_cache is not None and args.compile == "off":
        p.error("--compile-cache keeps a compiled step; --no-compile compiles none")
    if args.api_key_file is not None:
        args.api_key = args.api_key_file.read_text().strip()
        if not args.api_key:
            p.error(f"{args.api_key_file} is empty")
    return args


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_engine(args, model, budget=None):
    """The cache and engine ``args`` describe, for ``model``; with ``budget`` (an unbound
    :class:`ScaledBudget` over the fleet's ledger), a cache of the whole budget drawing on it
    (the budget bound to the cache's page size here)."""
    from vmcache import KVSpec, VMKVCache
    from vmcache.engine import Engine, NgramDrafter
    from vmcache.paged_fallback import PagedKVCache

    kv_dtype = KV_DTYPES[args.kv_dtype]
    granularity = "token" if kv_dtype is torch.int8 else "head"
    spec = KVSpec.from_hf_config(model.config, kv_dtype=kv_dtype, kv_granularity=granularity)
    pool = int(args.pool_mib * 2**20)
    extra, keep = {}, None
    if budget is not None:
        from vmcache.server.fleet import CHUNK_PAGES

        pool = int((args.kv_budget_mib or args.pool_mib) * 2**20)
        extra = {"budget": budget, "chunk_pages": CHUNK_PAGES}
        keep = CHUNK_PAGES if args.cache == "vm" else None  # blocks: nothing to give back
    prefix = not args.no_prefix_caching
    swap = pool if args.preemption == "swap" else None
    rollback = 4 if args.speculative else 0
    if args.cache == "paged":
        kv = PagedKVCache(spec, pool_bytes=pool, max_seq_len=args.max_seq_len,
                          max_seqs=args.max_seqs, prefix_caching=prefix, swap_bytes=swap,
                          rollback_tokens=rollback, **extra)  # fmt: skip
    else:
        kv = VMKVCache(spec, args.max_seqs, args.max_seq_len, pool_bytes=pool,
                       prefix_caching=prefix, swap_bytes=swap,
                       rollback_tokens=rollback, **extra)  # fmt: skip
    if budget is not None:
        budget.bind_page_bytes(kv.config.page_bytes)
    drafter = NgramDrafter(k=4) if args.speculative else None
    compile = {"on": True, "off": False, "auto": "auto"}[args.compile]
    cache_dir = None if compile is False else args.compile_cache or default_compile_cache()
    with compiling_notice(compile is not False, cache_dir):
        engine = Engine(model, kv, preemption=args.preemption,
                        max_batch_tokens=args.max_batch_tokens, speculative=drafter,
                        compile=compile, compile_cache=cache_dir,
                        keep_free_pages=keep)  # fmt: skip
    # on a shared budget, nothing that fits its limits fails for want of pages another holder
    # can give: the engine waits for them, each request bounded by its own deadline
    # (--request-timeout-s), instead of failing every request in flight after a minute
    engine.max_wait_s = None
    return engine


def default_compile_cache() -> Path:
    """``~/.cache/vmcache/compiled``: the server's compiled steps, kept between starts."""
    return Path.home() / ".cache" / "vmcache" / "compiled"


@contextlib.contextmanager
def compiling_notice(on: bool, cache_dir, every_s: float = 15.0):
    """While an engine is built that may compile its step: say so and where it is kept, with
    an estimate (measured here, SmolLM2-135M on 2 cores: 16 s built from one layer, 80-90 s as
    the whole model's graph), and every
    ``every_s`` how long it has taken, until it is built."""
    if not on:
        yield
        return
    print(f"vmcache-server: the compiled step: loaded from {cache_dir}, or compiled into it on "
          "a first start on this model and machine (about 15-30 s on 2 CPU cores where its "
          "layers are alike, one compiled for all; else 2-3 s a layer; later starts load it in "
          "seconds; --no-compile skips it)", file=sys.stderr)  # fmt: skip
    done, t0 = threading.Event(), time.monotonic()

    def tick():
        while not done.wait(every_s):
            print(f"vmcache-server: still building the step ({time.monotonic() - t0:.0f} s)",
                  file=sys.stderr)  # fmt: skip

    threading.Thread(target=tick, daemon=True).start()
    try:
        yield
    finally:
        done.set()


def check_sleep_level(args, engine=None) -> None:
    """``--sleep-level 2`` drops the weights, which only an eager step can do (the compiled
    step keeps packed copies of them): refused at start, with the way out, rather than a
    model that never sleeps. Before an engine is built where ``--compile`` asks for the
    compiled step; after, where ``auto`` chose it."""
    from vmcache.engine.runner import ModelRunner

    if args.sleep_level != 2:
        return
    if args.compile == "on" or (engine is not None and not isinstance(engine.runner, ModelRunner)):
        step = "compiled" if engine is None else engine.compile_choice
        raise ValueError(f"--sleep-level 2 drops the weights, but the step is {step}: the "
                         "compiled step keeps packed copies of them; pass --no-compile with "
                         "it, or sleep at level 1")  # fmt: skip


def build_server(args, model=None, tokenizer=None):
    """``(Server, EngineLoop)`` for ``args``: every model loaded (``model`` and
    ``tokenizer``, when given, serve under every name: the first name ``model`` itself, the
    others a copy each, since engines step on their own threads and a step sets the model's
    attention for its length), its engine built (on the shared KV budget, with
    ``args.shared``), its loop started. The loop is the first model's."""
    import copy

    from vmcache.memory.budget import ScaledBudget
    from vmcache.models import load
    from vmcache.server.app import Server
    from vmcache.server.fleet import UNIT_BYTES, Ledger, budget_for, set_floor
    from vmcache.server.keeper import Keeper
    from vmcache.server.loop import EngineLoop
    from vmcache.server.metrics import Metrics
    from vmcache.server.served import Served

    dtype = MODEL_DTYPES[args.dtype]
    check_sleep_level(args)
    ledger = Ledger(args.kv_ledger) if args.shared else None
    total = int((args.kv_budget_mib or args.pool_mib) * 2**20) // UNIT_BYTES
    metrics, served = Metrics(), []
    try:
        for entry in args.models:
            if model is not None:
                m, tok = (model if not served else copy.deepcopy(model)), tokenizer
            else:
                m, tok = load(entry.source, dtype=dtype)
            budget = budget_for(ledger, entry.name, total) if ledger is not None else None
            scaled = None if budget is None else ScaledBudget(budget, unit_bytes=UNIT_BYTES)
            try:
                engine = build_engine(args, m, scaled)
                check_sleep_level(args, engine)
                floor = (set_floor(budget, scaled.k, engine.kv, args.floors.get(entry.name),
                                   args.max_seq_len) if budget is not None else 0)  # fmt: skip
            except BaseException:
                if budget is not None:
                    budget.close()
                raise
            reload = (None if model is not None
                      else lambda src=entry.source: load(src, dtype=dtype)[0])  # fmt: skip
            keeper = Keeper(budget, floor, units_per_page=scaled.k if scaled else 1,
                            sleep_after_s=args.sleep_after_s, sleep_level=args.sleep_level,
                            reload=reload)  # fmt: skip
            observer = metrics.model(entry.name)
            loop = EngineLoop(engine, tok, max_waiting=args.max_waiting, observer=observer,
                              keeper=keeper, threads=args.threads)  # fmt: skip
            observer.attach(loop)
            served.append(Served(entry.name, loop, keeper, entry.source))
    except BaseException:
        for s in served:
            s.close()
        if ledger is not None:
            ledger.close()
        raise
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    server = Server(served, api_key=args.api_key, metrics=metrics, ledger=ledger,
                    request_timeout_s=args.request_timeout_s, cors_origins=origins)  # fmt: skip
    for s in served:
        s.loop.start()
    return server, server.loop


def main(argv=None) -> int:
    import uvicorn

    args = parse_args(argv)
    # The engines step on threads of their own with --threads (default: torch's, one a core);
    # this thread loads and builds with one. OpenMP (libgomp) lets a team's workers wait
    # spinning between parallel regions only while it manages no more threads than there are
    # CPUs, and a team made here would stay for the process's life: each engine thread's
    # workers then sleep and are woken at every region (a decode step took 52 ms on the
    # engine's thread against 26 ms on the thread that had built it, SmolLM2, 2 cores)
    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(1)
    if not is_loopback(args.host) and args.api_key is None:
        print(f"vmcache-server: serving on {args.host} without an API key: anyone who can "
              "reach this port can use it (pass --api-key-file)", file=sys.stderr)  # fmt: skip
    from vmcache.memory.ledger import LedgerError

    try:
        server, _ = build_server(args)
    except (ValueError, LedgerError) as e:  # a flag or a ledger refused: said, nothing served
        print(f"vmcache-server: {e}", file=sys.stderr)
        return 2
    for name, m in server.models.items():
        kv = m.loop.engine.kv
        print(f"vmcache-server: model {name!r} ({m.source}), cache {args.cache} "
              f"({type(kv).__name__}), kv dtype {kv.spec.storage_dtype}, "
              f"{kv.capacity.num_pages} pages of {kv.config.page_bytes} bytes, "
              f"max_seqs {kv.config.max_seqs}, "
              f"max_seq_len {kv.config.max_seq_len}, prefix caching "
              f"{'off' if args.no_prefix_caching else 'on'}, preemption {args.preemption}, "
              f"speculative {'on' if args.speculative else 'off'}, step "
              f"{m.loop.engine.compile_choice}, {args.threads} torch thread(s) on its engine "
              "thread", file=sys.stderr)  # fmt: skip
    if server.ledger is not None:
        from vmcache.server.fleet import UNIT_BYTES

        b = next(iter(server.models.values())).keeper.budget
        print(f"vmcache-server: one KV budget of {b.total * UNIT_BYTES / 2**20:.1f} MiB for "
              f"{len(server.models)} model(s), ledger {server.ledger.path} (vmcache-kv "
              f"--ledger {server.ledger.path} show)", file=sys.stderr)  # fmt: skip
    print(f"vmcache-server: http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        uvicorn.run(server.app(), host=args.host, port=args.port, log_level="warning")
    finally:
        server.close()
    return 0


class Running:
    """A server run by uvicorn on a thread of this process (tests, benchmarks, notebooks):
    ``url`` is its ``/v1`` base; :meth:`close` stops uvicorn, then the engine loop."""

    def __init__(self, server, host: str = "127.0.0.1", port: int = 0,
                 start_timeout_s: float = 30.0) -> None:  # fmt: skip
        import socket
        import threading
        import time

        import uvicorn

        self.server = server
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}/v1"
        config = uvicorn.Config(server.app(), log_level="warning", timeout_graceful_shutdown=5)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]},
                                        name="vmcache-http", daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)

    def close(self, timeout_s: float = 10.0) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout_s)
        self.server.close(timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
