"""Run a function on N processes joined by a gloo process group on the CPU (what
``torchrun`` would start), and collect what each returns. A rank that raises returns its
traceback, re-raised here; a rank that dies returns nothing."""

import os
import pickle
import queue
import tempfile
import time
import traceback

from vmcache.distributed import forkserver


def _main(rank, world, init, fn, args, out, env):
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment now, not the fork server's when it started
    os.environ.update(env)
    torch.set_num_threads(1)  # one a rank (OMP_NUM_THREADS set here, after torch's import, gave 2)
    # what torchrun sets (transformers' tensor-parallel load reads them)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        # plain pickle bytes: tensors by value, not shared memory the dead child would take
        out.put((rank, "ok", pickle.dumps(fn(rank, *args))))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world=2, *args, timeout=240):
    """``fn(rank, *args)`` on ``world`` processes; returns ``{rank: result}`` of those that
    returned. ``fn`` must be importable (a module-level function)."""
    ctx = forkserver.context()  # ranks forked from one server's imports (it keeps its env)
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "init")
        procs = [ctx.Process(target=_main, args=(r, world, init, fn, args, out, dict(os.environ)))
                 for r in range(world)]  # fmt: skip
        for p in procs:
            p.start()
        results, errors = {}, []
        deadline = time.monotonic() + timeout
        # until every rank reported or died (the fault tests kill one)
        while len(results) < sum(p.exitcode in (None, 0) for p in procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(results))} "
                                     f"did not finish in {timeout} s")  # fmt: skip
            try:
                rank, status, value = out.get(timeout=0.5)
            except queue.Empty:
                continue
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = pickle.loads(value) if status == "ok" else value
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return results
