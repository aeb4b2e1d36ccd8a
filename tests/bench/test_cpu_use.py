"""benchmarks/cpu_use.py on real processes: a child that keeps a core busy is counted with
its parent's tree and left out of the parent's own threads; a thread that ran a quarter of
the wall time or more counts as busy, an idle one does not."""

import subprocess
import sys
import time

from repo import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from cpu_use import snapshot, used  # noqa: E402

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n" \
       "print('done', flush=True)\ntime.sleep(30)"  # fmt: skip


def test_a_busy_child_counts_in_the_tree_and_not_in_this_process():
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    try:
        mine, tree, t = snapshot(tree=False), snapshot(), time.perf_counter()
        assert child.stdout.readline().strip() == "done"  # it spun 0.6 s of CPU, then sleeps
        wall = time.perf_counter() - t
        own, all_ = used(mine, snapshot(tree=False), wall), used(tree, snapshot(), wall)
    finally:
        child.kill()
        child.wait()
    assert own["cpu_s"] < 0.3 and own["busy_threads"] == 0  # this process waited, idle
    assert all_["cpu_s"] >= 0.5 and all_["busy_threads"] >= 1  # the child's spin
    assert all_["top"][0][1] >= 0.5 and len(all_["top"]) <= 4
