"""Where ``vmcache-server`` runs torch's threads: its main thread (loading, building) with
one, each engine's own thread with ``--threads`` (default: torch's). libgomp lets a team's
workers wait spinning between parallel regions only while it manages no more threads than
there are CPUs; a team on the main thread outlives the start-up and made every region of the
engine's thread wait for its workers to wake (a SmolLM2 decode step 52 against 26 ms on 2
cores). Run in a process of its own: torch's thread settings are the process's."""

import json
import subprocess
import sys

import pytest
from real_model import tiny_chat_checkpoint

from vmcache.server.loop import EngineLoop

PROBE = """
import json, sys, torch, uvicorn
from vmcache.server import cli
seen = {}
build = cli.build_server
def built(args, *a, **k):
    seen["server"], loop = build(args, *a, **k)
    return seen["server"], loop
def run(app, **kw):  # instead of serving: what each thread runs torch with
    seen["main"] = torch.get_num_threads()
    seen["engines"] = [m.loop.query(lambda e: torch.get_num_threads())
                       for m in seen["server"].models.values()]
cli.build_server, uvicorn.run = built, run
assert cli.main(sys.argv[1:]) == 0
print(json.dumps({"main": seen["main"], "engines": seen["engines"]}))
"""


@pytest.mark.parametrize("threads", [None, "2"])
def test_the_engine_thread_runs_torch_threads_and_the_main_thread_one(tmp_path, threads):
    tiny_chat_checkpoint(tmp_path / "m")
    flags = ["--threads", threads] if threads else []
    out = subprocess.run([sys.executable, "-c", PROBE, "--model", f"a={tmp_path / 'm'}",
                          "--model", f"b={tmp_path / 'm'}", "--kv-budget-mib", "16",
                          "--no-compile", "--port", "0", *flags],
                         capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"main": 1, "engines": [2, 2]}, seen  # OMP_NUM_THREADS 2: torch's default
    assert "2 torch thread(s) on its engine thread" in out.stderr


def test_a_loop_refuses_threads_that_are_not_a_positive_int():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads"):
            EngineLoop(None, None, threads=bad)
