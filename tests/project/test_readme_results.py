"""Every result table in the README and docs/results.md is rendered from committed JSON: the
check passes on the files as committed, and catches a figure edited by hand."""

import copy
import importlib.util
import os
import re
import sys

from repo import ROOT

PATH = os.path.join(ROOT, "scripts", "render_readme.py")
spec = importlib.util.spec_from_file_location("render_readme", PATH)
render_readme = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render_readme)


def readme() -> str:
    """The files with generated blocks, one after the other (a block's name is unique)."""
    return "\n".join(open(p).read() for p in render_readme.DOCS)


def test_every_generated_block_matches_its_json():
    text = readme()
    names = [m.group(2) for m in render_readme.BLOCK.finditer(text)]
    assert set(names) == set(render_readme.BLOCKS), names  # every renderer has its block
    assert render_readme.differing(text) == []


def test_a_figure_edited_by_hand_is_caught():
    text = readme()
    for m in render_readme.BLOCK.finditer(text):
        body = m.group(3)
        digit = re.search(r"\| [^|]*?(\d)", body) or re.search(r"(\d)", body)  # a figure
        assert digit, m.group(2)
        k = m.start(3) + digit.start(1)
        edited = text[:k] + str((int(text[k]) + 1) % 10) + text[k + 1 :]
        assert render_readme.differing(edited) == [m.group(2)]


def test_no_figure_outside_the_blocks_cites_a_stale_results_file():
    text = readme()
    results = os.path.join(ROOT, "benchmarks", "results")
    for name in re.findall(r"benchmarks/results/([\w.-]+\.(?:png|json))", text):
        assert os.path.exists(os.path.join(results, name)), name


def test_the_vllm_verdict_can_say_misses():
    """bench-vllm's verdict checks the issue's goal (at most 0.8x vLLM's time, tokens equal,
    no recompiles after warm-up): the committed run meets it; the same run with our engine
    slower, or with one recompile, misses it."""
    speed = sys.modules["readme_speed"]
    name, doc = speed.newest("vllm-20??-*.json")
    assert speed.vllm(name, doc).count("MEETS the goal") == 2
    slow, recompiled = copy.deepcopy(doc), copy.deepcopy(doc)
    for r in slow["rows"]:
        s = r["engine_vm_compiled"]["seconds"]
        s["median"] = speed._vllm_best(r) * (speed.GOAL_VS_VLLM + 0.01)
    recompiled["rows"][0]["engine_vm_compiled"]["recompiles"] = 1
    assert speed.vllm(name, slow).count("MISSES the goal") == 2
    assert "MISSES the goal" in speed.vllm(name, recompiled)


def test_the_server_verdicts_can_say_misses():
    """bench-server's verdicts check issue 68's goals: the committed run meets them; the same
    run with 1.2x vLLM's tokens/s at 64 clients, a slower p99 TTFT at 1 client, one answer
    unequal, or a 16 s restart misses them."""
    server = sys.modules["readme_server"]
    name, doc = server.newest("server-20??-*.json")
    assert server.load(name, doc).count("**MEETS** the goal") == 2

    def edited(change) -> str:
        d = copy.deepcopy(doc)
        change(d, {(r["server"], r["clients"]): r for r in d["rows"]})
        return server.load(name, d)

    def vm(clients, key, value):
        return lambda d, by: by[("vm", clients)].__setitem__(key, value)

    def unequal(d, by):
        by[(by[("vm", 16)]["vs_vllm"], 16)]["equal_to_vm"] -= 1

    def slow_restart(d, by):
        d["startup_s"]["vm"]["cached"] = 16.0

    for change in (vm(64, "tok_per_s_vs_vllm", 1.2), vm(1, "ttft_p99_vs_vllm", 1.01), unequal,
                   slow_restart):  # fmt: skip
        assert edited(change).count("**MISSES** the goal") == 1
