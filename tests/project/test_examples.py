"""The plain-PyTorch example: incremental decode through the cache equals recomputing the
whole sequence, and the example script runs."""

import os
import runpy
import sys

import torch
from repo import ROOT

from vmcache import VMKVCache

EXAMPLES = os.path.join(ROOT, "examples")


def _tiny_llama():
    sys.path.insert(0, EXAMPLES)
    try:
        import tiny_llama
    finally:
        sys.path.remove(EXAMPLES)
    return tiny_llama


def test_incremental_decode_matches_full_recompute():
    mod = _tiny_llama()
    torch.manual_seed(0)
    model = mod.TinyLlama().eval()
    cache = VMKVCache(model.spec, max_seqs=4, max_seq_len=256, page_size=4096)
    prompts = [[5, 9, 13, 2, 7], list(range(20, 53))]
    seqs = [cache.new_sequence() for _ in prompts]
    logits = model.step(cache, seqs, prompts)
    history = [list(p) for p in prompts]
    for _ in range(6):
        nxt = logits.argmax(-1).tolist()
        for h, t in zip(history, nxt):
            h.append(t)
        logits = model.step(cache, seqs, [[t] for t in nxt])
    fresh = VMKVCache(model.spec, max_seqs=4, max_seq_len=256, page_size=4096)
    full = model.step(fresh, [fresh.new_sequence() for _ in history], history)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


def test_example_script_runs(capsys):
    runpy.run_path(os.path.join(EXAMPLES, "tiny_llama.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "shared" in out and out.count("sequence") == 3
