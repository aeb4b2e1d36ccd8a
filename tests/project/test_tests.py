"""The tests' own layout (docs/DESIGN.md, tests/): every test module sits in a layer's folder,
and none imports another test module (what several share is a set-up module beside
conftest.py), so a folder runs on its own and a file moves without breaking its neighbours."""

import ast

from repo import ROOT

FOLDERS = {"memory", "sequences", "prefix", "kernels", "hf", "engine", "server", "distributed",
           "bench", "models", "properties", "gpu", "project", "vllm"}  # fmt: skip


def modules() -> list:
    return sorted((ROOT / "tests").rglob("test_*.py"))


def test_every_test_module_is_in_a_layer_folder():
    found = modules()
    assert len(found) > 70
    outside = [p.relative_to(ROOT).as_posix() for p in found
               if p.parent.parent != ROOT / "tests" or p.parent.name not in FOLDERS]  # fmt: skip
    assert outside == []


def test_no_test_module_imports_another():
    tests = modules()
    names = {p.stem for p in tests}
    bad = []
    for p in tests + sorted((ROOT / "tests").rglob("*_cases.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in names:
                bad.append(f"{p.relative_to(ROOT).as_posix()}: from {node.module}")
            elif isinstance(node, ast.Import):
                bad += [f"{p.relative_to(ROOT).as_posix()}: import {a.name}" for a in node.names
                        if a.name in names]  # fmt: skip
    assert bad == []
