"""The engine tests' tiny Llama (engine_cases.model, module-scoped) as a fixture of this
folder: a test takes ``model`` and gets it, unless its module defines its own; and ``steps``,
where compiled steps are kept."""

import os

import pytest
from engine_cases import model  # noqa: F401


@pytest.fixture(scope="session")
def steps(tmp_path_factory):
    """One directory of compiled-step packages (``Engine(compile_cache=...)``) for the
    session, shared by xdist's workers (beside their own temporary folders): a model's step
    compiles once, later engines load it. Private, as the compiled step requires."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent
    where = root / "compiled-steps"
    where.mkdir(mode=0o700, exist_ok=True)
    return where
