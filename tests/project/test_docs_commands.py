"""Every shell command README.md and docs/guide.md show runs as a user would type it: the
ones no other test runs are run here, through bash, with the venv's executables first on the
PATH and results sent to a temporary directory ($VMCACHE_RESULTS, which the harness reads);
the others are named with the test or script that runs them, which must hold the command's
words in order. A command added to the docs and run nowhere fails
`test_every_shown_command_is_run_somewhere`."""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness_rows import check_compute_rows
from repo import ROOT

from vmcache.bench import real, traces

DOCS = ("README.md", "docs/guide.md")
BIN = str(Path(sys.executable).parent)
STARTS = ("python", "make", "pip", "curl", "torchrun", "vmcache-server", "vmcache-bench",
          "vmcache-kv")  # fmt: skip

SERVER = "vmcache-server --cache vm --pool-mib 256"
# (max_tokens: a chat's default is what the context leaves, and it samples at temperature 1
# unless told: an unbounded answer ran past two minutes once on a busy machine)
CURL = ("curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d "
        "'{\"model\": \"smollm2-135m-instruct\", \"messages\": [{\"role\": \"user\", "
        "\"content\": \"Hi!\"}], \"max_tokens\": 64}'")  # fmt: skip
HARNESS = ("python -m vmcache.bench --mode sizing --quick",
           "python -m vmcache.bench --mode compute --quick")  # fmt: skip
DISAGG = "python -m vmcache.distributed.launch --mode disagg --check"
TORCHRUN = "torchrun --nproc_per_node 2 -m vmcache.distributed.launch --mode disagg --cache paged"
# beside another `make test` worker: one thread, as tests/conftest.py gives each worker (two
# processes of 2 OpenMP threads each on 2 cores ran the compute mode 4x slower)
ONE_THREAD = {"OMP_NUM_THREADS": "1"} if os.environ.get("PYTEST_XDIST_WORKER") else {}
# the guide's several models on one budget: the server, the ledger read and limited, sleep
LEDGER = "/tmp/vmcache-kv.db"
MULTI = ("vmcache-server --model chat=smollm2-135m-instruct --model code=smollm2-135m-instruct "
         f"--kv-budget-mib 256 --max-seq-len 1024 --kv-ledger {LEDGER} "
         "--sleep-after-s 300")  # fmt: skip
KV_SHOW = f"vmcache-kv --ledger {LEDGER} show"
KV_LIMIT = f"vmcache-kv --ledger {LEDGER} set-limit chat 64 --preempt"
SLEEP = "curl -s -X POST 'localhost:8000/sleep?model=code&level=1'"
IS_SLEEPING = "curl -s 'localhost:8000/is_sleeping?model=code'"
WAKE = "curl -s -X POST 'localhost:8000/wake_up?model=code'"
MULTI_STEPS = (KV_SHOW, KV_LIMIT, SLEEP, IS_SLEEPING, WAKE)
RUN_HERE = {SERVER, CURL, *HARNESS, DISAGG, TORCHRUN, MULTI, *MULTI_STEPS}
# command -> the file that runs it as typed
RUN_ELSEWHERE = {
    "python -m vmcache.distributed.launch --mode tp --nproc 2 --check":
        "tests/distributed/test_serve_distributed.py",
    "make test": ".ci/run",  # CI's command
    # vLLM's server with vmcache underneath (`make test-vllm`, in vLLM's venv)
    "python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 "
    "--worker-cls vmcache.vllm.worker.VmcacheCPUWorker "
    "--scheduler-cls vmcache.vllm.scheduler.VmcacheScheduler --additional-config "
    "'{\"vmcache\": {\"ledger\": \"/tmp/vllm-kv.ledger\", \"budget_mib\": 2048}}'":
        "tests/vllm/test_vllm_server.py",
    "make bench": "scripts/time_fresh_clone.py",  # the committed fresh-clone measurement
}  # fmt: skip


def shown_commands() -> list[str]:
    """The command lines of the docs' shell blocks (```bash, or unlabeled ones whose lines
    start with a command), continuation lines joined, comments and prompts dropped."""
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if lang not in ("bash", "sh", "shell", ""):
                continue
            joined = re.sub(r"\\\n\s*", "", body)
            for line in joined.splitlines():
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:  # prose or a diagram in an unlabeled block
                    continue
                if words and (lang or words[0] in STARTS):
                    out.append(shlex.join(words))
    return out


def _norm(cmd: str) -> str:
    return shlex.join(shlex.split(cmd, comments=True))


def test_every_shown_command_is_run_somewhere():
    shown = shown_commands()
    assert len(shown) >= 9, shown  # the parser still finds the blocks
    known = {_norm(c) for c in RUN_HERE} | {_norm(c) for c in RUN_ELSEWHERE}
    assert not [c for c in shown if c not in known], "shown but run by no test"
    assert not [c for c in known if c not in shown], "run here but no longer shown"
    for cmd, where in RUN_ELSEWHERE.items():
        text = (ROOT / where).read_text()
        words = shlex.split(cmd)
        # each word in order, as a string literal or on a command line
        at = 0
        for w in words[1:] if words[0] == "python" else words:
            found = text.find(w, at)
            assert found >= 0, f"{where} does not run `{cmd}` (no {w!r} after offset {at})"
            at = found + len(w)


def _bash(cmd: str, tmp_path, timeout: float, **kw):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}",
           "VMCACHE_RESULTS": str(tmp_path), **ONE_THREAD}  # fmt: skip
    return subprocess.run(["bash", "-c", cmd], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout, **kw)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("cmd", HARNESS)
def test_the_readme_harness_commands(cmd, tmp_path):
    done = _bash(cmd, tmp_path, 240)
    assert done.returncode == 0, done.stderr[-2000:]
    (saved,) = tmp_path.glob("ab-*.json")
    doc = json.loads(saved.read_text())
    rows = doc["rows"]
    assert doc["args"]["quick"] and rows and "wall time" in done.stdout
    if "sizing" in cmd:  # every trace, the heavy-tailed one also at --quick's one rate
        assert {r["trace"] for r in rows if "trace" in r} == set(traces.TRACES)
        assert any(r.get("rate_rps") == 8.0 for r in rows if "trace" in r)
        plots = ("waste", "latency")
    else:  # both caches, the radix rows, the trained model's rows
        check_compute_rows(rows)
        plots = ("compute",)
    for suffix in plots:  # the report's plots beside the JSON
        assert saved.with_name(f"{saved.stem}-{suffix}.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [DISAGG, TORCHRUN])
def test_the_guides_launcher_commands(cmd, tmp_path):
    done = _bash(cmd, tmp_path, 300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["world"] == 2
    if "--check" in cmd:  # (the launcher's defaults: 16 requests, a 4-layer random Llama)
        r0, r1 = report["ranks"]
        assert r0["equal_to_one_process"] is True and r0["digest"] == r1["digest"]
        assert r0["handoff"]["handoffs"] == r1["handoff"]["handoffs"] == r0["requests"] == 16
        assert r0["handoff"]["data_messages"] == 16 * 8  # 4 layers x K/V, one message each


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _serving(cmd: str, tmp_path, name: str, deadline_s: float = 120):
    """``cmd`` started through bash, listening on port 8000 within ``deadline_s``; (process,
    its log)."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **ONE_THREAD}
    log = tmp_path / f"{name}.log"  # a file, not a pipe nobody reads while the server runs
    with log.open("w") as err:
        server = subprocess.Popen(["bash", "-c", f"exec {cmd}"], env=env, cwd=tmp_path,
                                  stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    deadline = time.monotonic() + deadline_s
    while _port_free(8000):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError(f"{cmd} did not listen within {deadline_s} s: "
                                 f"{log.read_text()[-2000:]}")  # fmt: skip
        time.sleep(0.2)
    assert server.poll() is None, log.read_text()[-2000:]  # ours listens, not another
    return server, log


def _stop(server) -> None:
    server.terminate()
    server.wait(timeout=30)


@pytest.mark.slow
def test_the_readme_server_and_curl_and_the_guides_several_models(tmp_path):
    # one test: both servers listen on port 8000, one after the other
    if not real.available():
        pytest.skip("the embedded model is not cached; `make test` fetches it")
    if not _port_free(8000):
        pytest.skip("port 8000 is taken on this machine")
    # the server's default compiles its step on a first start (~70 s on 2 cores, more beside
    # another test worker) into ~/.cache/vmcache/compiled; the multi-model server loads it
    server, log = _serving(SERVER, tmp_path, "server", deadline_s=420)
    try:
        done = _bash(CURL, tmp_path, 120)
        assert done.returncode == 0, done.stderr + log.read_text()[-2000:]
        answer = json.loads(done.stdout)
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"].strip()
        assert "step compiled" in log.read_text()  # the default: the compiled step
    finally:
        _stop(server)
    if os.path.exists(LEDGER):  # a ledger left by an earlier run (its holders dead)
        os.unlink(LEDGER)
    server, log = _serving(MULTI, tmp_path, "multi")
    try:
        out = [_bash(cmd, tmp_path, 60) for cmd in MULTI_STEPS]
        assert all(o.returncode == 0 for o in out), [o.stderr for o in out]
        show, limit, slept, asleep, woken = (o.stdout for o in out)
        assert "chat" in show and "code" in show and "limit MiB" in show
        assert "64.0" in limit
        assert json.loads(slept)["is_sleeping"] and json.loads(asleep) == {"is_sleeping": True}
        assert json.loads(woken) == {"model": "code", "is_sleeping": False}
        done = _bash(CURL.replace("smollm2-135m-instruct", "code"), tmp_path, 120)
        assert json.loads(done.stdout)["model"] == "code", done.stdout + log.read_text()[-2000:]
    finally:
        _stop(server)
        if os.path.exists(LEDGER):
            os.unlink(LEDGER)


def test_the_guides_vmcache_kv_help_is_the_commands_own():
    guide = (ROOT / "docs/guide.md").read_text()
    env = {**os.environ, "COLUMNS": "100"}
    for args in (["--help"], ["--ledger", "LEDGER", "set-limit", "--help"]):
        done = subprocess.run([f"{BIN}/vmcache-kv", *args], capture_output=True, text=True,
                              env=env, timeout=60)  # fmt: skip
        assert done.returncode == 0
        assert f"$ vmcache-kv {' '.join(args)}\n{done.stdout.rstrip()}\n" in guide, args
