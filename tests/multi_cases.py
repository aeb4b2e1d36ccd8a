"""Set-up for the several-models tests: a server of two (or more) models on one KV budget,
built as the CLI builds it (the random 2-layer model under every name), the ledger read while
it serves, and load sent to a model from threads with the official ``openai`` client.

KV arithmetic of the tiny model (2 layers, 3 KV heads of 64, fp32; VMKVCache: 64 KiB pages,
one per layer and K/V every 85 tokens): a sequence of t tokens maps 4·ceil(t/85) pages,
1.25 MiB at 400 tokens; the floor at --max-seq-len 512 is 24 pages (1.5 MiB)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from server_cases import BASE, http, root, unlabelled

from vmcache.memory.ledger_admin import read
from vmcache.server.cli import Running, build_server, parse_args

MIB = 2**20
SHARED = ["--max-seq-len", "512", "--max-waiting", "64"]


def start_multi(real, names=("a", "b"), *extra) -> Running:
    model, tok = real
    models = [a for n in names for a in ("--model", f"{n}=tiny")]
    server, _ = build_server(parse_args([*BASE, *SHARED, *models, *extra]), model, tok)
    return Running(server)


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key="none", max_retries=0, timeout=300)


def complete(running, model: str, prompt: list[int], max_tokens: int):
    c = client(running)
    return c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                temperature=0, extra_body={"ignore_eos": True})  # fmt: skip


def prompt(i: int, length: int) -> list[int]:
    """A distinct prompt of ``length`` token ids (no two share a prefix page)."""
    return [1000 + (i * 7919 + j * 31) % 40000 for j in range(length)]


def held_mib(running) -> dict[str, float]:
    """Each model's KV memory held now, by the ledger."""
    view = read(running.server.ledger.path)
    return {h.name: h.held_pages * view.unit_bytes / MIB for h in view.holders}


class Sampler:
    """The ledger read every 20 ms on a thread until :meth:`stop`: each model's peak held
    MiB and the peak of their sum."""

    def __init__(self, running) -> None:
        self.running, self.peak, self.total_peak = running, {}, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            held = held_mib(self.running)
            for k, v in held.items():
                self.peak[k] = max(self.peak.get(k, 0.0), v)
            self.total_peak = max(self.total_peak, sum(held.values()))
            time.sleep(0.02)

    def stop(self) -> "Sampler":
        self._stop.set()
        self._thread.join()
        return self


def burst(running, jobs: list[tuple[str, list[int], int]]) -> list:
    """Every ``(model, prompt, max_tokens)`` at once; their completions, in order."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda j: complete(running, *j), jobs))


def metric(running, name: str, model: str) -> float:
    return unlabelled(http("GET", root(running) + "/metrics")[1], model)[f"vmcache:{name}"]


def query(running, model: str, fn, timeout_s: float = 30.0):
    """``fn(engine)`` on model ``model``'s engine thread."""
    return running.server.models[model].loop.query(fn, timeout_s=timeout_s)
