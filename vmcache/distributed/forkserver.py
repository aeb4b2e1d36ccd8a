"""Worker processes started from one fork server that imported the heavy modules once.

A spawned process starts a new interpreter and imports torch, transformers and the engine
again: seconds of CPU a process before it does any work (about 7 s on a 2-core machine). A
fork server (``multiprocessing``'s "forkserver" start method) is one such interpreter, started
at the first process a parent asks for, with :data:`ENGINE_IMPORTS` (or the caller's list)
imported; every process after it is a fork of that server, its imports already done. The
server has run nothing but those imports (no thread pool, lock or CUDA context yet), so a
fork copies none into a worker, as a fork of the parent could.

A parent has one fork server: the first caller's ``preload`` is the one it gets (any later
list only changes which imports a worker finds done). Its workers inherit the environment the
server started with, not the parent's at the time of each start: pass what changes.
"""

from __future__ import annotations

import torch.multiprocessing as mp

ENGINE_IMPORTS = ("torch", "torch.distributed", "transformers.modeling_utils",
                  "transformers.models.llama.modeling_llama", "vmcache.engine")  # fmt: skip


def context(preload=ENGINE_IMPORTS):
    """The "forkserver" multiprocessing context, ``preload`` (module names) imported by its
    server before its first fork."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx
