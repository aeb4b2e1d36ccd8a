"""A small C library compiled once a process with the system's C compiler (``cc``, ``gcc``) into
a private temporary directory and opened through ``ctypes``: the CPU kernels' build. Where no
compiler works, :attr:`CFunction.reason` says why and callers keep their torch path."""

from __future__ import annotations

import ctypes
import hashlib
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# -O3 -march=native: the machine's own vector ISA
BASE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# on x86, AVX-512 registers where the machine has them (gcc prefers 256-bit vectors unless told)
WIDE_VECTORS = ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()


class CFunction:
    """``source`` compiled with ``BASE_FLAGS + flags`` (linked with ``libs``, e.g. ``-l...``)
    and its function ``name`` taking ``argtypes`` (returning nothing), built at the first use
    of :attr:`fn`, :attr:`reason` or :meth:`available` and kept for the process: :attr:`fn` (a
    ``ctypes`` function), or None with :attr:`reason`. A kernel module holds one at import;
    nothing is compiled until used. ``global_symbols``: the library's symbols open to the
    libraries loaded after it (``RTLD_GLOBAL``: a compiled package that calls them)."""

    def __init__(self, source: str, flags: tuple[str, ...], name: str, argtypes: list,
                 libs: tuple[str, ...] = (), global_symbols: bool = False) -> None:  # fmt: skip
        self._spec = (source, flags, name, argtypes)
        self._link = (libs, global_symbols)
        self._built: tuple | None = None  # (fn or None, reason): set once, at the first use

    @property
    def fn(self):
        return (self._built or self._build())[0]

    @property
    def reason(self) -> str:
        return (self._built or self._build())[1]

    def variant(self, *flags: str) -> CFunction:
        """The same function built with ``flags`` added (a ``-D`` that picks another of its
        code paths), its own library, built at its own first use."""
        source, base, name, argtypes = self._spec
        return CFunction(source, (*base, *flags), name, argtypes, *self._link)

    def available(self) -> tuple[bool, str]:
        """(whether the function runs here, why not)."""
        fn, reason = self._built or self._build()
        return fn is not None, reason

    def _build(self) -> tuple:
        self._built = self._compile(*self._spec)
        return self._built

    def _compile(self, source: str, flags: tuple[str, ...], name: str, argtypes: list) -> tuple:
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            return None, "no C compiler (cc, gcc) on PATH"
        self._dir = tempfile.TemporaryDirectory(prefix="vmcache-kernels-")  # 0700
        tag = hashlib.sha256(source.encode()).hexdigest()[:12]
        src, lib = Path(self._dir.name) / f"k{tag}.c", Path(self._dir.name) / f"k{tag}.so"
        src.write_text(source)
        libs, global_symbols = self._link
        mode = ctypes.RTLD_GLOBAL if global_symbols else ctypes.DEFAULT_MODE
        try:
            subprocess.run([cc, *BASE_FLAGS, *flags, str(src), "-o", str(lib), *libs,
                            "-lm"], check=True, capture_output=True, timeout=120)  # fmt: skip
            fn = getattr(ctypes.CDLL(str(lib), mode=mode), name)
        except (OSError, subprocess.SubprocessError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            return None, f"{cc} failed: {exc} {err.decode(errors='replace')[-400:]}".strip()
        fn.argtypes, fn.restype = argtypes, None
        return fn, ""
