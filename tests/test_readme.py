"""Every Python snippet of the README runs on its own, as a newcomer would paste it (in a
fresh process, outside the repository, so the root's kernels/ folder is not importable)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
SNIPPETS = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "README.md")).read(), re.S)


def test_the_readme_has_its_snippets():
    assert len(SNIPPETS) >= 4


@pytest.mark.parametrize("i", range(len(SNIPPETS)))
def test_readme_snippet_runs_on_its_own(i, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", SNIPPETS[i]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, f"snippet {i}:\n{SNIPPETS[i]}\n{res.stderr[-3000:]}"
