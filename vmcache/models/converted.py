"""A converted copy of an embedded GGUF model, so loads after the first skip the conversion:
transformers reads a GGUF file by parsing it and dequantizing every tensor (~30 s for
SmolLM2-135M on 2 cores); its ``save_pretrained`` output (safetensors, no pickle) loads in a
few seconds.

    ~/.cache/vmcache/models/
        SmolLM2-135M-Instruct.Q4_1.gguf                             the verified download
        SmolLM2-135M-Instruct.Q4_1.float32.transformers-5.25.0/     this copy (0700; files 0600)
            config.json  model.safetensors  tokenizer.json  ...  vmcache-manifest.json

One copy per dtype and transformers release: two environments on one machine (make test's
newest and oldest tiers, make bench's) each keep theirs instead of converting over the
other's on every run. The manifest records the GGUF file's SHA-256, the dtype, the
transformers version that converted it, and each file's size and SHA-256. The copy is used
only when all of them match (each file re-hashed: ~1 s for 540 MB); otherwise it is rebuilt
from the GGUF file, into a temporary folder renamed into place, so a reader never sees half a
copy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from vmcache.models.embedded import Embedded, sha256_of

MANIFEST = "vmcache-manifest.json"
MAX_MANIFEST_BYTES = 1 << 16


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def path_for(gguf: Path, dtype: torch.dtype) -> Path:
    """Where the copy of ``gguf`` in ``dtype`` made by this transformers lives."""
    import transformers

    return gguf.with_name(f"{gguf.stem}.{_dtype_name(dtype)}.transformers-"
                          f"{transformers.__version__}")  # fmt: skip


def _expected(entry: Embedded, dtype: torch.dtype) -> dict:
    import transformers

    return {"gguf_sha256": entry.sha256, "dtype": _dtype_name(dtype),
            "transformers": transformers.__version__}  # fmt: skip


def valid(d: Path, entry: Embedded, dtype: torch.dtype) -> bool:
    """Whether ``d`` is an intact copy of ``entry`` in ``dtype`` made by this transformers."""
    m = d / MANIFEST
    try:
        if m.stat().st_size > MAX_MANIFEST_BYTES:
            return False
        doc = json.loads(m.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        return False
    if any(doc.get(k) != v for k, v in _expected(entry, dtype).items()):
        return False
    present = {p.name for p in d.iterdir()} - {MANIFEST}
    if present != set(doc["files"]):
        return False
    for name, (size, digest) in doc["files"].items():
        f = d / name
        if not f.is_file() or f.stat().st_size != size or sha256_of(f) != digest:
            return False
    return True


def write_manifest(d: Path, entry: Embedded, dtype: torch.dtype) -> None:
    """Record every file of ``d`` (size, SHA-256) with what it was converted from; files and
    the manifest become private."""
    files = {}
    for f in sorted(d.iterdir()):
        os.chmod(f, 0o600)
        files[f.name] = (f.stat().st_size, sha256_of(f))
    (d / MANIFEST).write_text(json.dumps({**_expected(entry, dtype), "files": files}, indent=1))
    os.chmod(d / MANIFEST, 0o600)


def ensure(gguf: Path, entry: Embedded, dtype: torch.dtype) -> Path:
    """The directory of a valid converted copy (made now if there is none)."""
    d = path_for(gguf, dtype)
    if valid(d, entry, dtype):
        return d
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=dtype, **kw)
    # the weights are dequantized already (plain ``dtype`` tensors); what marks the model as
    # "quantized with gguf" only refuses save_pretrained (this object is ours, made here)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=gguf.parent, prefix=f".{d.name}-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_manifest(tmp, entry, dtype)
        if d.exists():  # a stale or damaged copy: replaced whole
            shutil.rmtree(d)
        os.replace(tmp, d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return d
