"""The import graph matches the layers docs/DESIGN.md draws: every module of the package is
placed in a layer, and no module imports from a layer above its own. Also the public member
count of each cache class, as DESIGN.md states it."""

import ast
import os
import re

from vmcache.paged_fallback import PagedKVCache

from vmcache import VMKVCache
from vmcache.sequences.deprecated import is_deprecated

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SOURCES = {"vmcache": "vmcache", "vmcache.kernels": "kernels",
           "vmcache.paged_fallback": "paged_fallback"}  # fmt: skip


def design() -> str:
    return open(os.path.join(ROOT, "docs", "DESIGN.md")).read()


def layers() -> dict[str, int]:
    block = re.search(r"<!-- import-layers -->\n(.*?)<!-- end: import-layers -->", design(),
                      re.S).group(1)  # fmt: skip
    out = {}
    for row in block.splitlines()[2:]:
        cells = row.split("|")
        rank = int(cells[1].split()[0])
        for name in re.findall(r"`([\w.]+)`", cells[2]):
            out[name] = rank
    return out


def modules() -> dict[str, str]:
    """module name -> file, for every module the wheel installs."""
    out = {}
    for package, folder in SOURCES.items():
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, folder))
                parts = rel[:-3].split(os.sep)
                name = ".".join([package, *parts]).removesuffix(".__init__")
                if not (package == "vmcache" and parts[0] in ("kernels", "paged_fallback")):
                    out[name] = os.path.join(d, f)
    return out


def imports(name: str, path: str) -> set[str]:
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {t for t in found if t == "vmcache" or t.startswith("vmcache.")}


def layer_of(name: str, table: dict[str, int]) -> int | None:
    best = None
    for prefix, rank in table.items():
        if (name == prefix or name.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, rank)
    return None if best is None else best[1]


def test_every_module_is_placed_in_a_layer():
    table = layers()
    unplaced = [m for m in modules() if layer_of(m, table) is None]
    assert not unplaced, f"not in docs/DESIGN.md's layer table: {unplaced}"
    assert set(table.values()) == set(range(7))


def test_no_module_imports_from_a_layer_above_its_own():
    table = layers()
    up = []
    for name, path in modules().items():
        mine = layer_of(name, table)
        for target in imports(name, path):
            theirs = layer_of(target, table)
            if theirs is not None and theirs > mine:
                up.append(f"{name} (layer {mine}) imports {target} (layer {theirs})")
    assert not up, up


def test_the_check_sees_an_upward_import():
    table = layers()
    assert layer_of("vmcache.memory.pool", table) < layer_of("vmcache.engine.engine", table)
    assert "vmcache.memory.budget" in imports(
        "vmcache.memory.pool", modules()["vmcache.memory.pool"]
    )


def test_public_member_counts_are_as_documented():
    counts = {c.__name__: sum(not n.startswith("_") and not is_deprecated(c, n) for n in dir(c))
              for c in (VMKVCache, PagedKVCache)}  # fmt: skip
    now = design().split("now", 1)[1]
    for name, n in counts.items():
        assert f"`{name}` {n}" in now, (name, n)
