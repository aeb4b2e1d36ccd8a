"""The harness end to end, as `make bench` runs it, at a tiny scale: every section of the
default path (sizing with its rate sweep, compute, the radix rows, the real-model rows, the
report, the save, the plots; every trace and the trained model's rows are the README's two
--quick commands', run as typed in tests/project/test_docs_commands.py), and each other --mode
through its save (quant: tests/bench/test_bench_quant.py, which checks its rows too). Each run
must exit cleanly, write JSON that loads back, and hold nothing but plain JSON values in its
rows (a cache object in a row crashed `make bench` at its very end once: issue 32). The
real-model rows run on a 2-layer random model with the embedded model's tokenizer and chat
template (the same code, prompts and vocabulary; the trained model's own answers are the
real-model tier's, in tests/models/test_real_model.py)."""

import json
import os

import pytest
import torch
from harness_rows import check_compute_rows
from real_model import tiny_chat_checkpoint

from vmcache.bench import real
from vmcache.bench.__main__ import main as bench_main
from vmcache.bench.common import check_plain, save

PLAIN = (str, int, float, bool, type(None))


pytestmark = pytest.mark.slow  # end to end: scheduled first (tests/conftest.py)


def _plain_everywhere(value, where="doc"):
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), f"{where}: key {k!r}"
            _plain_everywhere(v, f"{where}[{k!r}]")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _plain_everywhere(v, f"{where}[{i}]")
    else:
        assert isinstance(value, PLAIN), f"{where} is a {type(value).__name__}"


def _load_one(out_dir, name):
    paths = sorted(out_dir.glob(f"{name}-*.json"))
    assert len(paths) == 1, paths
    doc = json.loads(paths[0].read_text())
    assert doc["benchmark"] == name and doc["rows"]
    _plain_everywhere(doc)
    return doc, paths[0]


@pytest.fixture(scope="module")
def real_args(tmp_path_factory):
    """``--real-model`` a tiny chat checkpoint, or nothing where the embedded model (whose
    tokenizer it takes) is not cached: the harness then says it skipped those rows."""
    if not real.available():
        return []
    return ["--real-model", tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"))]


# the default path's sections at a tiny scale: no --mode (both), a capacity trace (queued at
# t = 0, the verdicts) and the heavy one at one rate
TINY_DEFAULT = ["--traces", "enterprise,heavy", "--sample", "6", "--budget-gb", "1", "--rates", "8",
                "--jobs", "1",
                "--compute-requests", "2", "--real-requests", "2", "--repeats", "1",
                "--compute-rates", "8", "--budgets", "4"]  # fmt: skip


def test_the_default_harness_path_runs_to_its_save(tmp_path, capsys, real_args):
    pytest.importorskip("matplotlib")
    bench_main([*TINY_DEFAULT, *real_args, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    doc, path = _load_one(tmp_path, "ab")
    rows = doc["rows"]
    assert {r["trace"] for r in rows if "trace" in r} == {"enterprise", "heavy"}
    assert any(r.get("rate_rps") == 8.0 for r in rows if "trace" in r)  # the sweep
    compute, served = check_compute_rows(rows)
    if real.available():  # the real-model rows name the checkpoint they ran on
        assert {r["model"] for r in served} == {os.path.basename(real_args[1])}
    assert all(r["kv_dtype"] == "auto" for r in compute)
    assert doc["args"]["mode"] == "both" and doc["wall_s"] > 0
    assert "saved" in out and "verdict" in out
    for suffix in ("waste", "latency", "compute"):  # the report's plots
        assert path.with_name(f"{path.stem}-{suffix}.png").stat().st_size > 0


def test_the_real_rows_run_on_the_model_real_model_names():
    """--real-model takes what vmcache.models.load takes (here the embedded model's converted
    checkpoint directory, as a user's own would be), and the rows name it by its last part
    (the default path's test runs the rows themselves)."""
    from vmcache.bench.__main__ import parser
    from vmcache.models import DEFAULT_MODEL, checkpoint_dir

    if not real.available():
        pytest.skip("the embedded model is not cached (python -m vmcache.models fetch)")
    d = str(checkpoint_dir(DEFAULT_MODEL))
    assert parser().parse_args(["--real-model", d]).real_model == d
    assert parser().parse_args([]).real_model == DEFAULT_MODEL
    model, tok = real.smol(d)
    assert model.config.num_hidden_layers == 30 and tok.chat_template
    assert real.row_name(d) == os.path.basename(d)  # no machine's own path in a results file
    assert real.row_name(DEFAULT_MODEL) == DEFAULT_MODEL and real.label() == real.NAME
    assert real.available(d) and not real.available(d + "-missing")


@pytest.mark.parametrize(
    "mode, extra",
    [("spec", []), ("tiers", []), ("elastic", ["--loads", "1", "--period", "0.5"])],
)
def test_each_mode_runs_to_its_save(tmp_path, mode, extra, request):
    if mode == "spec":  # real-model rows
        extra = [*extra, *request.getfixturevalue("real_args")]
    if mode != "elastic":  # one thread beside the other worker (elastic's engines use one)
        extra = [*extra, "--threads", "1"]
    bench_main(["--mode", mode, "--quick", "--out", str(tmp_path), *extra])
    doc, path = _load_one(tmp_path, mode)
    if mode == "elastic":
        assert {r["load"] for r in doc["rows"] if r["part"] == "budget"} == {1}
    if mode == "spec" and real.available():  # the real-task rows: their own file
        doc, _ = _load_one(tmp_path, "spec_real")
        assert all(r["answers_equal_none"] for r in doc["rows"])


def test_an_unknown_option_is_refused_outside_the_delegated_modes(tmp_path):
    with pytest.raises(SystemExit):
        bench_main(["--mode", "sizing", "--loads", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench_main(["--mode", "elastic", "--loads", "3", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_save_names_the_field_that_is_not_a_value_and_writes_nothing(tmp_path):
    rows = [{"cache": "vmcache", "tok_per_s": 1.0}, {"cache": "paged", "kv_dtype": torch.int8}]
    with pytest.raises(TypeError, match=r"rows\[1\]\['kv_dtype'\] is a dtype"):
        save("probe", torch.device("cpu"), rows, out_dir=tmp_path)
    with pytest.raises(TypeError, match=r"extra\['args'\]\['t'\] is a Tensor"):
        save("probe", torch.device("cpu"), rows[:1], {"args": {"t": torch.ones(1)}},
             out_dir=tmp_path)  # fmt: skip
    with pytest.raises(TypeError, match="key 3 of type int"):
        check_plain({3: "x"})
    assert not list(tmp_path.iterdir())
    check_plain([{"a": [1, 2.5, None, True, ("t", "u")], "b": {"c": "d"}}])  # values pass
