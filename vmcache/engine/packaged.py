"""The CPU's compiled step kept as an AOTInductor package: exported once (``torch.export``,
the step's sizes as dims), compiled ahead of time by inductor with the weights frozen
(``torch._inductor.aoti_compile_and_package``), and loaded by later processes in seconds.
torch.compile cannot do that: inductor's own cache refuses a graph with frozen weights (oneDNN's
packed weights cannot be serialized by it), so every process compiled the whole model again.

A package is code (a shared library the process loads), so it is treated as a file from outside
the process even when this process wrote it:

    <dir>/                 created 0700; refused unless this user owns it and nobody else
      <key>.pt2            can write it (the same for each file in it)
      <key>.json           {"sha256", "bytes"} of the package, checked before loading

``<key>`` is a SHA-256 over everything that shapes the compiled code: the model's class, config
and every weight's bytes, the cache's storage dtype, the compiler's settings and the rest of
inductor's configuration as the process has it (a user's ``TORCHINDUCTOR_*`` setting, e.g.
kernel profiling, changes the code), torch's and vmcache's versions, the CPU's vector ISA and
the thread count (the cache's size and layout come in as inputs: one package serves every
cache).
Files are written under a temporary name and moved into place (``os.replace``), so a reader
sees a whole package or none. A package that fails its checksum is compiled again and
replaced. After loading, the runner's warm-up still checks the logits
against the eager step's, as after a fresh compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import stat
from pathlib import Path

import torch

import vmcache
from vmcache.engine.packed_linears import pack_linears
from vmcache.kernels import aoti_shims, cpu_gemm
from vmcache.models.embedded import sha256_of

KEY_VERSION = 5  # bump when what goes into a package changes
# inductor's setting that a package build writes and leaves behind (build() restores it; the
# key leaves it out, so a process that built one keys the next as a fresh process does)
LEAKED = "aot_inductor.metadata"
# The sizes the step is traced at (export traces shapes; every size is symbolic after).
EXAMPLE_TOKENS = 4
EXAMPLE_SEQS = 16


def _private_dir(root: Path) -> Path:
    """``root`` created 0700 if missing; ``ValueError`` unless this user owns it and no one
    else may write to it."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(root)
    return root


def _check_private(path: Path) -> None:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"compile cache: {path} is a symbolic link; refusing to use it")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ValueError(f"compile cache: {path} must be owned by this user and writable by "
                         f"no one else (mode {stat.filemode(st.st_mode)}); refusing to load "
                         "code from it")  # fmt: skip


def _linear_layout() -> str:
    """What the package's linear layers run on: vmcache's packed layout, or inductor's own
    (oneDNN) where the kernel cannot be built here."""
    return cpu_gemm.LAYOUT if cpu_gemm.available()[0] else "inductor"


def package_key(model: torch.nn.Module, store_dtype: torch.dtype, settings: dict,
                weights: bool = True) -> str:  # fmt: skip
    """The package's name: SHA-256 (hex) over everything that shapes its code (module
    docstring): the model, the cache's storage dtype, the compiler's ``settings`` and
    inductor's configuration. ``weights=False``: the weights' names, dtypes and shapes, not
    their bytes (a package that takes its weights as inputs)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    # (the portable form, as inductor's own cache keys it: without trace dirs and compile
    # threads, which shape no code, and custom graph passes, which inductor keys by their
    # uuid() and this key does not: a package built under a user's own pass is not told apart)
    portable = inductor_config.save_config_portable()  # (a new dict)
    portable.pop(LEAKED, None)  # (what it holds is the machine's: keyed below)
    inductor = repr(sorted(portable.items()))
    h = hashlib.sha256()
    head = {"key": KEY_VERSION, "vmcache": vmcache.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "isa": str(pick_vec_isa()), "threads": torch.get_num_threads(),
            "model": type(model).__qualname__, "config": model.config.to_json_string(),
            "store": str(store_dtype), "linear": _linear_layout(),
            "shims": aoti_shims.available()[0],
            "example": [EXAMPLE_TOKENS, EXAMPLE_SEQS],
            "settings": {k: repr(v) for k, v in sorted(settings.items())},
            "inductor": hashlib.sha256(inductor.encode()).hexdigest()}  # fmt: skip
    h.update(json.dumps(head, sort_keys=True).encode())
    for name, t in model.state_dict(keep_vars=False).items():
        t = t.detach().contiguous().cpu() if weights else t
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        if weights:
            h.update(t.view(-1).view(torch.uint8).numpy())  # the bytes in place, not a copy
    return h.hexdigest()


class PackageDir:
    """A private directory of compiled-step packages (module docstring)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = _private_dir(Path(root))

    def path(self, key: str) -> Path:
        return self.root / f"{key}.pt2"

    def lookup(self, key: str) -> Path | None:
        """The package's path if it is here, private and whole (its checksum matches)."""
        pkg, meta = self.path(key), self.root / f"{key}.json"
        if not (pkg.is_file() and meta.is_file()):
            return None
        _check_private(pkg)
        _check_private(meta)
        try:
            want = json.loads(meta.read_text())
            ok = (isinstance(want, dict) and want.get("bytes") == pkg.stat().st_size
                  and want.get("sha256") == sha256_of(pkg))  # fmt: skip
        except (OSError, ValueError):
            ok = False
        return pkg if ok else None

    def save(self, key: str, build) -> Path:
        """``build(path)`` writes the package at a temporary path of this process; it, then
        its checksum, are moved into place (atomic replace). → the package's path."""
        tmp = self.root / f".building-{key}-{os.getpid()}.pt2"
        tmp_meta = tmp.with_suffix(".json")
        try:
            build(str(tmp))
            os.chmod(tmp, 0o600)
            meta = {"sha256": sha256_of(tmp), "bytes": tmp.stat().st_size}
            fd = os.open(tmp_meta, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(meta, f)
            os.replace(tmp, self.path(key))  # a reader that sees the checksum sees the package
            os.replace(tmp_meta, self.root / f"{key}.json")
        finally:
            tmp.unlink(missing_ok=True)
            tmp_meta.unlink(missing_ok=True)
        return self.path(key)


def step_dims() -> tuple:
    """``torch.export`` dims of the step's inputs ``(ids [1, N], pos [1, N], keep [B],
    store [E], layout [L, 4], write [N], read [B, S], lens [2, B])``: N from 2 (a lone decode
    runs as two copies of itself); N, B, S and the storage's size E unbounded, so one package
    serves every step and every cache of the model (each layer's place in the storage comes
    in ``layout``)."""
    from torch.export import Dim

    n, b, s = Dim("tokens", min=2), Dim("seqs", min=1), Dim("span", min=1)
    return {1: n}, {1: n}, {0: b}, {0: Dim("storage", min=1)}, None, {0: n}, {0: b, 1: s}, {1: b}


def example_inputs(store: torch.Tensor, layout: torch.Tensor) -> tuple:
    """Step inputs for export: EXAMPLE_TOKENS tokens, EXAMPLE_SEQS sequences of 8 positions
    (the values are not read: export traces shapes)."""
    n, b, span = EXAMPLE_TOKENS, EXAMPLE_SEQS, 8
    return (torch.zeros(1, n, dtype=torch.long), torch.zeros(1, n, dtype=torch.long),
            torch.arange(b), store, layout, torch.arange(n), torch.zeros(b, span, dtype=torch.long),
            torch.tensor([[1] * b, [span] * b]))  # fmt: skip


def build(module: torch.nn.Module, example: tuple, settings: dict, path: str) -> None:
    """Export ``module`` (the step: ``example``'s inputs → logits) and compile it into an
    AOTInductor package at ``path`` with inductor's ``settings``."""
    ep = torch.export.export(module, example, dynamic_shapes=step_dims(), strict=False)
    compile_package(pack_linears(ep, example, step_dims()), settings, path)


def compile_package(ep: torch.export.ExportedProgram, settings: dict, path: str) -> None:
    """``ep`` compiled by AOTInductor with inductor's ``settings`` into a package at ``path``;
    its operators called through their C shims where they are available here
    (:mod:`vmcache.kernels.aoti_shims`; the package's key says whether they were)."""
    config = torch._inductor.config
    # (the build writes the machine's AOTI_* metadata into inductor's global configuration
    # and leaves it there: patched, the process's own comes back after; and it adds its own
    # settings to the dict it is given: a copy, so the caller's keys the next package alike)
    with config.patch(LEAKED, dict(config.aot_inductor.metadata)):
        torch._inductor.aoti_compile_and_package(
            ep, package_path=path, inductor_configs={**settings, **aoti_shims.inductor_settings()}
        )


def load(path: Path):
    """The package at ``path`` as a callable: the step's inputs → logits (the operators' C
    shims loaded first where they are available: a package keyed with them calls them)."""
    aoti_shims.available()
    return torch._inductor.aoti_load_package(str(path))
