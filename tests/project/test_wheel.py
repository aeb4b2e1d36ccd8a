"""Installed as users install it: the package list in pyproject.toml covers every folder, and a
built wheel, installed into a fresh virtual environment outside the checkout, imports every
module (an editable install, which every other test uses, hides a package left out)."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from repo import ROOT

tomllib = pytest.importorskip("tomllib")
# the modules that import vLLM (the `vllm` extra): imported where it is installed
VLLM_MODULES = ("vmcache.vllm.worker", "vmcache.vllm.gpu_worker", "vmcache.vllm.scheduler")


def _listed() -> set[str]:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(conf["packages"])


def test_every_package_folder_is_listed():
    packages = _listed()
    folders = {}  # package name -> folder, for every folder with code in it
    for src in (ROOT / "vmcache").rglob("*.py"):
        folders[".".join(src.parent.relative_to(ROOT).parts)] = src.parent
    assert set(folders) == packages, f"missing: {set(folders) - packages}, stale: " \
        f"{packages - set(folders)}"  # fmt: skip
    for folder in folders.values():  # regular packages (walk_packages skips namespace ones)
        assert (folder / "__init__.py").exists(), folder


@pytest.mark.slow
def test_built_wheel_imports_every_module(tmp_path):
    dist, src = tmp_path / "dist", tmp_path / "src"
    # from a copy of the sources: setuptools reuses a checkout's build/lib without cleaning it,
    # so modules moved or deleted since an earlier build would ride along in the wheel
    shutil.copytree(ROOT / "vmcache", src / "vmcache", ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(dist), str(src)],
                   check=True, cwd=tmp_path)  # fmt: skip
    (wheel,) = dist.glob("vmcache-*.whl")
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    # the wheel alone, installed with this pip into the fresh environment; its dependencies
    # (torch, triton, transformers) come from this environment's site-packages, added after
    # it by a .pth line (which does not run this environment's editable-install hook)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    site, str(wheel)], check=True)  # fmt: skip
    Path(site, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    script = (
        "import importlib, importlib.util, pkgutil, vmcache\n"
        "assert 'site-packages' in vmcache.__file__ and '" + str(ROOT) + "' not in "
        "vmcache.__file__, vmcache.__file__\n"
        "vllm = importlib.util.find_spec('vllm') is not None\n"
        "names = [m.name for m in pkgutil.walk_packages(vmcache.__path__, 'vmcache.')\n"
        "         if not m.name.startswith('vmcache.bench.__main__')\n"
        "         and (vllm or m.name not in " + repr(VLLM_MODULES) + ")]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(len(names))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([py, "-c", script], check=True, capture_output=True, text=True,
                         cwd=tmp_path, env=env)  # fmt: skip
    assert int(out.stdout.split()[-1]) >= 50  # every module, not just the package
