"""One KV budget across server processes (``--kv-ledger``): two ``vmcache-server``
processes on one ledger, a burst on one using what the other does not, a server naming
another size refused, and a server killed with SIGKILL whose pages go back to the other; on
both caches (a PagedKVCache's blocks are counted against the budget)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from multi_cases import prompt
from real_model import tiny_chat_checkpoint

from vmcache.memory.ledger_admin import read

FLAGS = ["--max-seq-len", "512", "--max-seqs", "16", "--kv-budget-mib", "8", "--threads", "1",
         "--no-compile"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """``python -m vmcache.server`` in its own process, healthy or failed."""

    def __init__(self, name, directory, ledger, *extra) -> None:
        self.name, self.port = name, free_port()
        cmd = [sys.executable, "-m", "vmcache.server", "--model", f"{name}={directory}",
               "--port", str(self.port), "--kv-ledger", ledger, *FLAGS, *extra]  # fmt: skip
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s=120.0) -> "Proc":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.p.poll() is None, self.p.communicate()[1]
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"server {self.name} did not start")

    def burst(self, n: int, tokens: int = 100) -> list:
        c = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)
        job = lambda i: c.completions.create(model=self.name, prompt=prompt(i, 300),  # noqa: E731
                                             max_tokens=tokens, temperature=0,
                                             extra_body={"ignore_eos": True})  # fmt: skip
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(job, range(n)))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self.p.communicate()


def peak_while(ledger, name, fn) -> tuple[float, object]:
    """(the most MiB ``name`` held while ``fn()`` ran, its result)."""
    peak, done = 0.0, []
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fn)
        while not fut.done():
            view = read(ledger)
            for h in view.named(name):
                peak = max(peak, h.held_pages * view.unit_bytes / 2**20)
            time.sleep(0.02)
        done.append(fut.result())
    return peak, done[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("cache", ["vm", "paged"])
def test_two_servers_share_one_budget_and_a_killed_ones_pages_return(checkpoint, tmp_path, cache):
    ledger = str(tmp_path / "kv.db")
    x = Proc("x", checkpoint, ledger, "--cache", cache).wait_healthy()
    y = Proc("y", checkpoint, ledger, "--cache", cache).wait_healthy()
    try:
        other = Proc("z", checkpoint, ledger, "--kv-budget-mib", "16", "--cache", cache)
        assert other.p.wait(120) == 2
        assert "the ledger's total is 2048 pages, not 4096" in other.p.communicate()[1]
        view = read(ledger)
        assert sorted(h.name for h in view.holders) == ["x", "y"]
        # 1.5 MiB floors: 24 pages of 64 KiB, or 32 blocks of 48 KiB
        assert [h.min_pages for h in view.holders] == [384, 384]
        peak, out = peak_while(ledger, "x", lambda: x.burst(10))  # 12.5 MiB asked
        assert all(o.usage.completion_tokens == 100 for o in out)
        assert peak > 5.0  # what y does not use: all but y's floor
        # x killed while it serves: its pages go back to y
        with ThreadPoolExecutor(1) as pool:
            pool.submit(x.burst, 10)
            deadline = time.monotonic() + 30
            while read(ledger).named("x")[0].held_pages * 4096 < 3 << 20:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            os.kill(x.p.pid, signal.SIGKILL)
            x.p.wait(10)
        assert [h.name for h in read(ledger).holders] == ["y"]
        peak, out = peak_while(ledger, "y", lambda: y.burst(10))
        assert all(o.usage.completion_tokens == 100 for o in out)
        assert peak > 6.5  # the whole budget is y's now
        with urllib.request.urlopen(y.url + "/is_sleeping") as r:
            assert json.loads(r.read()) == {"is_sleeping": False}
        # y put to sleep over HTTP: its pages and its floor leave the ledger; its next
        # request wakes it with the same tokens
        before = [o.choices[0].text for o in y.burst(2, 12)]
        sleep = urllib.request.Request(y.url + "/sleep?level=1", method="POST")
        with urllib.request.urlopen(sleep) as r:
            assert json.loads(r.read())["is_sleeping"]
        (row,) = read(ledger).holders
        assert (row.asleep, row.held_pages, row.min_pages) == (True, 0, 0)
        assert [o.choices[0].text for o in y.burst(2, 12)] == before
        (row,) = read(ledger).holders
        assert not row.asleep and row.min_pages == 384
    finally:
        for p in (x, y):
            p.stop()


def test_a_server_stopped_mid_burst_loses_its_pages_and_finishes_its_burst_when_resumed(
    checkpoint, tmp_path
):
    """SIGSTOP in the middle of a burst: the stopped server's pages used to stay held (30 s
    and more: servers took no lease). Now they go back within its lease (5 s), the other
    server bursts into the whole budget, and when the stopped one resumes it registers again
    within the total, sheds, and answers every request of its burst; the ledger ends equal
    to what each holds."""
    ledger = str(tmp_path / "kv.db")
    x = Proc("x", checkpoint, ledger).wait_healthy()
    y = Proc("y", checkpoint, ledger).wait_healthy()
    try:
        with ThreadPoolExecutor(1) as pool:
            burst = pool.submit(x.burst, 6, 60)
            deadline = time.monotonic() + 30
            while read(ledger).named("x")[0].held_pages * 4096 < 3 << 20:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            os.kill(x.p.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            while read(ledger).named("x"):
                assert time.monotonic() - t0 < 15, "the stopped server kept its pages"
                time.sleep(0.1)
            peak, out = peak_while(ledger, "y", lambda: y.burst(8, 60))
            assert all(o.usage.completion_tokens == 60 for o in out)
            assert peak > 6.5  # the whole budget is y's meanwhile
            os.kill(x.p.pid, signal.SIGCONT)
            done = burst.result(timeout=300)
        assert all(o.usage.completion_tokens == 60 for o in done)  # every request answered
        deadline = time.monotonic() + 10
        while True:  # each row back to its holder's account, within the total
            view = read(ledger)
            if len(view.holders) == 2 and view.held_pages <= view.total_pages:
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.1)
    finally:
        for p in (x, y):
            if p.p.poll() is None:
                os.kill(p.p.pid, signal.SIGCONT)
            p.stop()
