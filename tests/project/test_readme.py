"""Every Python snippet of the README and the docs runs on its own, as a newcomer would paste it
(in a fresh process, outside the repository, where only the installed package is importable);
and the README stays one screen: what it is, five ways in, two commands, links."""

import os
import re
import subprocess
import sys

import pytest
from repo import ROOT

# the user's pages (docs/DESIGN.md is the architecture card: its code is sketches, not runnable)
DOCS = sorted(os.listdir(os.path.join(ROOT, "docs")))
PAGES = ["README.md"] + [f"docs/{p}" for p in DOCS if p.endswith(".md") and p != "DESIGN.md"]
SNIPPETS = [snip for page in PAGES
            for snip in re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, page)).read(),
                                   re.S)]  # fmt: skip


def test_the_readme_has_its_snippets():
    assert len(SNIPPETS) >= 7


def test_the_readme_starts_a_user_in_one_screen():
    text = open(os.path.join(ROOT, "README.md")).read()
    heads = re.findall(r"^## (.*)$", text, re.M)
    assert heads == ["Five ways in", "The two commands", "Read on"], heads
    assert len(re.findall(r"```python", text)) == 3 and text.count("\n") < 140
    drop_in = text.index("from vmcache.hf import VMCache")
    assert text[:drop_in].count("\n") < 50  # the drop-in snippet within the first screen
    for link in re.findall(r"\]\((docs/[\w.]+)\)", text):
        assert os.path.exists(os.path.join(ROOT, link)), link


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(SNIPPETS)))
def test_readme_snippet_runs_on_its_own(i, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", SNIPPETS[i]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, f"snippet {i}:\n{SNIPPETS[i]}\n{res.stderr[-3000:]}"
