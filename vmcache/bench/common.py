"""One timer, one results writer, one table printer for every benchmark."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata as _md
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

# benchmarks/results of the checkout (the package is installed editable from it)
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def provenance() -> dict:
    """What a result needs to be reproduced: the commit (and whether the tree was dirty), the
    CPU model, Python and the versions of the packages that matter."""
    root = RESULTS.parents[1]

    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                 timeout=10)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)  # fmt: skip
    except OSError:
        pass
    versions = {}
    for name in ("torch", "triton", "transformers", "numpy", "cuda-bindings"):
        try:
            versions[name] = _md.version(name)
        except _md.PackageNotFoundError:
            versions[name] = None
    # dirty = code differs from the commit; result files being rewritten do not count
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                 ":(exclude)benchmarks/results")  # fmt: skip
    return {"git_sha": git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None
            else None, "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "packages": versions}  # fmt: skip


def _portable(value):
    """Absolute paths inside the checkout become relative; other absolute paths keep only
    their file name (results must not carry one machine's directories)."""
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        root = str(RESULTS.parents[1])
        return os.path.relpath(value, root) if value.startswith(root) else os.path.basename(value)
    return value


def time_fn(
    fn: Callable[[], object], device: torch.device, iters: int = 20, warmup: int = 3
) -> float:
    """Median seconds per call: CUDA events on the GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_repeats(
    fn: Callable[[], object], device: torch.device, repeats: int = 5, iters: int = 20
) -> dict:
    """``repeats`` timings (each the median of ``iters`` calls, seconds) → median, min, max:
    the spread a figure must be shown with."""
    runs = [time_fn(fn, device, iters=iters, warmup=3 if i == 0 else 1) for i in range(repeats)]
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs),
            "repeats": repeats}  # fmt: skip


PLAIN = (str, int, float, bool, type(None))


def check_plain(value, where: str = "rows") -> None:
    """Raise ``TypeError`` naming the first value under ``value`` that JSON cannot hold as it
    is (a cache, a model, a tensor, a dtype): results are values, never live objects. Keys
    must be strings; tuples count as lists.

    >>> check_plain([{"kv_dtype": object()}])
    Traceback (most recent call last):
    TypeError: rows[0]['kv_dtype'] is a object, not a plain JSON value
    """
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has a key {k!r} of type {type(k).__name__}, not str")
            check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, PLAIN):
        raise TypeError(f"{where} is a {type(value).__name__}, not a plain JSON value")


def save(name: str, device: torch.device, rows: list[dict], extra: dict | None = None,
         out_dir: Path | None = None) -> Path:  # fmt: skip
    """Write ``{name}-{date}-{device}.json`` with the machine described; returns the path.
    Every row value and every ``extra`` value must be plain JSON (:func:`check_plain` names
    the first that is not, before anything is written); the file is replaced atomically."""
    check_plain(rows, "rows")
    check_plain(extra or {}, "extra")
    out_dir = Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = device_name(device)
    date = _dt.date.today().isoformat()
    tag = "".join(ch if ch.isalnum() else "-" for ch in dev).strip("-").lower()[:40]
    path = out_dir / f"{name}-{date}-{'gpu-' if device.type == 'cuda' else 'cpu-'}{tag}.json"
    doc = {
        "benchmark": name,
        "date": date,
        "device": dev,
        "torch": torch.__version__,
        **provenance(),
        "rows": rows,
        **_portable(extra or {}),
    }
    text = json.dumps(doc, indent=1)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def save_and_plot(name: str, device: torch.device, rows: list[dict], extra: dict | None,
                  out_dir: Path | None, plot) -> Path:  # fmt: skip
    """:func:`save`, say where, and draw ``plot(rows, png_path)`` next to the JSON when
    matplotlib is installed (the benchmarks run without it)."""
    path = save(name, device, rows, extra, out_dir=out_dir)
    print(f"saved {path}")
    try:
        plot(rows, path.with_suffix(".png"))
    except ImportError:
        pass
    return path


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, widths))
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(x) for x in cells])


def parse_args(doc: str, argv=None) -> tuple[argparse.Namespace, torch.device]:
    """The options every benchmark takes: ``--device`` and ``--quick``."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="a small grid, for CI and the CPU")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    return args, torch.device(args.device)


def add_out_arg(ap: argparse.ArgumentParser) -> None:
    """``--out DIR`` for the JSON and plots; the command line's default comes from
    ``$VMCACHE_RESULTS`` (set by scripts/gpu_check.sh), else benchmarks/results."""
    ap.add_argument("--out", default=os.environ.get("VMCACHE_RESULTS") or str(RESULTS),
                    help="directory for results (JSON, PNG)")  # fmt: skip


def add_threads_arg(ap: argparse.ArgumentParser, default: int = 2) -> None:
    """``--threads N``: torch's intra-op threads for the run (the figures in docs/results.md
    were measured at 2, this machine's cores), restored when the run ends."""
    ap.add_argument("--threads", type=int, default=default,
                    help=f"torch threads for the run ({default}; restored after)")  # fmt: skip


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to ``n`` inside the block, the caller's after it (a
    mode called in-process, as the tests do, leaves the process as it found it)."""
    if n < 1:
        raise ValueError(f"--threads must be at least 1, got {n}")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
