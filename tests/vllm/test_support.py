"""What vmcache.vllm refuses of vLLM's configuration before anything is held
(vmcache/vllm/support.py), on vLLM's own engine configurations as ``vllm serve`` builds them
(no model is started): tensor, pipeline and data parallelism, async scheduling, a model with
several attention types under the hybrid manager, a budget or floor below one sequence, a
ledger that cannot be trusted; and what it accepts. Needs vLLM (``make test-vllm``)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.engine.arg_utils")
MODEL = os.environ.get("VMCACHE_VLLM_MODEL")
if not MODEL:
    pytest.skip("VMCACHE_VLLM_MODEL (the fp32 SmolLM2 directory) is not set: run `make test-vllm`",
                allow_module_level=True)  # fmt: skip

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from vmcache.vllm.support import check_supported, one_sequence_bytes  # noqa: E402

BLOCK = 5898240  # SmolLM2-135M fp32: 30 layers, 3 KV heads of 64, K and V, 128 tokens a block


def config(model=MODEL, vm=None, **kw):
    args = EngineArgs(model=model, dtype="float32", max_model_len=1024, skip_tokenizer_init=True,
                      additional_config={"vmcache": vm or {}}, **kw)  # fmt: skip
    return args.create_engine_config()


def test_what_it_accepts_and_the_one_sequence_it_needs():
    assert check_supported(config()).budget_mib is None
    need = one_sequence_bytes(1024, 128, BLOCK)
    assert need == 9 * BLOCK  # 8 blocks and vLLM's null block
    assert check_supported(config(vm={"budget_mib": need / 2**20})).budget_mib == need / 2**20


@pytest.mark.parametrize("kw, vm, match", [
    ({"data_parallel_size": 2}, {}, "data parallelism"),
    ({"pipeline_parallel_size": 2}, {}, "pipeline_parallel_size 2"),
    ({}, {"budget_mib": 50}, "budget_mib 50 MiB is below one max_model_len sequence"),
    ({}, {"ledger": "/tmp/x.db", "floor_mib": 10}, "floor_mib 10 MiB is below one"),
    ({}, {"ledger": "/nonexistent/dir/kv.db"}, "no directory"),
])  # fmt: skip
def test_what_it_refuses(kw, vm, match):
    with pytest.raises(ValueError, match=match):
        check_supported(config(vm=vm, **kw))


def test_async_scheduling_is_refused_where_vllm_would_run_it():
    cfg = config()
    assert not cfg.scheduler_config.async_scheduling  # vLLM's CPU platform turns it off
    cfg.scheduler_config.async_scheduling = True  # as vLLM's GPU platform may leave it
    with pytest.raises(ValueError, match="--no-async-scheduling"):
        check_supported(cfg)


def test_a_model_with_several_attention_types_needs_the_hybrid_manager_off(tmp_path):
    from transformers import Gemma3TextConfig

    c = Gemma3TextConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=128,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         vocab_size=1000, sliding_window=64)  # fmt: skip
    c.architectures = ["Gemma3ForCausalLM"]
    c.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache-manager"):
        check_supported(config(str(tmp_path)))
    check_supported(config(str(tmp_path), disable_hybrid_kv_cache_manager=True))


def test_a_ledger_it_cannot_trust_is_refused(tmp_path):
    from vmcache.memory.ledger import SharedBudget
    from vmcache.memory.ledger_rows import LedgerError

    real = tmp_path / "kv.db"
    SharedBudget(real, 100).close()
    link = tmp_path / "link.db"
    os.symlink(real, link)
    with pytest.raises(LedgerError, match="symbolic link"):
        check_supported(config(vm={"ledger": str(link)}))
