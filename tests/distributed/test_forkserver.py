"""vmcache.distributed.forkserver: workers are forks of one server that imported the preload
before its first fork (not spawned interpreters that import everything again), and they
keep the environment the server started with (what a caller that changes it must pass)."""

import json
import subprocess
import sys

# run in a fresh interpreter: a process has one fork server, started by its first caller
CHILD = """
import json, multiprocessing, os, sys
from vmcache.distributed import forkserver

def report(q):
    q.put({"parent": os.getppid(), "preloaded": "colorsys" in sys.modules,
           "env": os.environ.get("PROBE")})

if __name__ == "__main__":
    os.environ["PROBE"] = "before"
    ctx = forkserver.context(["colorsys"])  # a module nothing else here imports
    assert ctx.get_start_method() == "forkserver"
    q = ctx.Queue()
    seen = []
    for value in ("first", "second"):
        p = ctx.Process(target=report, args=(q,))
        p.start()
        seen.append(q.get(timeout=120))
        p.join(30)
        os.environ["PROBE"] = value
    print(json.dumps({"me": os.getpid(), "workers": seen}))
"""


def test_workers_fork_from_one_server_with_the_preload_imported(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    first, second = out["workers"]
    assert first["preloaded"] and second["preloaded"]  # imported by the server, not by them
    assert first["parent"] == second["parent"] != out["me"]  # both forks of the one server
    # the environment the server started with, not the caller's at each start
    assert first["env"] == second["env"] == "before"
