"""The compiled step's packages (vmcache.engine.packaged): a key that changes with everything
that shapes the compiled code and with nothing else; a private directory, whole files only,
a damaged package never loaded; an unsafe directory refused before anything compiles. (The
packages the compiled step builds and loads: tests/engine/test_engine_compiled.py.)"""

import copy
import json
import os

import pytest
import torch
from engine_cases import make

from vmcache.engine import Engine
from vmcache.engine.compiled import CompiledRunner
from vmcache.engine.packaged import PackageDir, package_key
from vmcache.kernels import aoti_shims

SETTINGS = {"freezing": True, "max_autotune": True}


def key(model, dtype=torch.float32, settings=SETTINGS):
    return package_key(model, dtype, settings)


def test_the_key_follows_what_shapes_the_code_and_nothing_else(model):
    base = key(model)
    assert key(model) == base and key(copy.deepcopy(model)) == base  # same weights, same key
    assert len(base) == 64 and int(base, 16) >= 0
    changed = copy.deepcopy(model)
    with torch.no_grad():
        w = changed.model.layers[1].mlp.down_proj.weight
        w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(float("inf")))  # one ulp
    assert key(changed) != base
    assert key(model, dtype=torch.bfloat16) != base
    assert key(model, settings={**SETTINGS, "max_autotune": False}) != base
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):  # the user's own
        assert key(model) != base
    with torch._inductor.config.patch(post_grad_custom_post_pass=None, compile_threads=1):
        assert key(model) == base  # (inductor's cache ignores both: they shape no code)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # inductor splits its loops for a thread count
        assert key(model) != base
    finally:
        torch.set_num_threads(threads)
    assert key(model) == base  # reading the model changed nothing


def test_the_key_says_whether_the_package_calls_the_c_shims(model, monkeypatch):
    """A package built to call the operators' C shims loads only where they are loaded: one
    built where they are not is another package."""
    if not aoti_shims.available()[0]:
        pytest.skip(f"no C shims here: {aoti_shims.available()[1]}")
    base = key(model)
    monkeypatch.setattr(aoti_shims, "available", lambda: (False, "not here"))
    assert aoti_shims.inductor_settings() == {}
    assert key(model) != base


def _write(data: bytes):
    def build(path):
        with open(path, "wb") as f:
            f.write(data)

    return build


def test_a_package_is_stored_private_and_whole(tmp_path):
    where = PackageDir(tmp_path / "steps")
    assert (where.root.stat().st_mode & 0o777) == 0o700
    assert where.lookup("k") is None
    path = where.save("k", _write(b"code" * 1000))
    assert where.lookup("k") == path and path.read_bytes() == b"code" * 1000
    assert (path.stat().st_mode & 0o777) == 0o600
    assert json.loads((where.root / "k.json").read_text())["bytes"] == 4000
    assert sorted(p.name for p in where.root.iterdir()) == ["k.json", "k.pt2"]  # no leftovers


@pytest.mark.parametrize("damage", ["flip", "truncate", "no checksum", "bad checksum"])
def test_a_damaged_package_is_never_loaded(tmp_path, damage):
    where = PackageDir(tmp_path)
    path = where.save("k", _write(bytes(range(256)) * 64))
    meta = tmp_path / "k.json"
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[1000] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-1])
    elif damage == "no checksum":
        meta.unlink()
    else:
        meta.write_text("[not, json")
    assert where.lookup("k") is None
    assert where.save("k", _write(b"fresh")) == path and where.lookup("k") == path  # rebuilt


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    where = PackageDir(tmp_path)

    def build(path):
        _write(b"half")(path)
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        where.save("k", build)
    assert list(tmp_path.iterdir()) == [] and where.lookup("k") is None


def test_a_directory_others_can_write_or_a_link_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match="writable by no one else"):
        PackageDir(shared)
    link = tmp_path / "link"
    link.symlink_to(PackageDir(tmp_path / "real").root)
    with pytest.raises(ValueError, match="symbolic link"):
        PackageDir(link)
    where = PackageDir(tmp_path / "ok")
    path = where.save("k", _write(b"x"))
    os.chmod(path, 0o666)  # a package someone else could have rewritten
    with pytest.raises(ValueError, match="writable by no one else"):
        where.lookup("k")


def test_an_unsafe_cache_is_refused_before_anything_compiles(model, tmp_path):
    os.chmod(tmp_path, 0o777)
    kv = make("vm", 40)
    with pytest.raises(ValueError, match="writable by no one else"):
        CompiledRunner(model, kv, compile_cache=tmp_path)
    assert kv.stats().num_sequences == 0
    with pytest.raises(ValueError, match="pass compile=True"):
        Engine(model, make("vm", 40), compile_cache=tmp_path)
