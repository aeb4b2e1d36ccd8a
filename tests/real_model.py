"""The real-model tier's shared pieces: the embedded SmolLM2-135M-Instruct, loaded once per
test session from the cache `make test` fills (python -m vmcache.models fetch), and chat
prompts built with its own template."""

from __future__ import annotations

import functools

import pytest
import torch

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 2 + 2? Answer with a number only.",
    "Give me a synonym for happy.",
    "Translate 'good morning' into Spanish.",
]
SYSTEM = (
    "You are a concise assistant for a hardware store. You answer questions about tools, "
    "paint, wood, screws and garden supplies. Keep every answer short, polite and practical, "
    "and say when a question is outside what the store sells. "
    + " ".join(
        f"Aisle {i}: {what}. Prices on aisle {i} are on the yellow labels; ask a member of staff "
        f"in the blue apron if a label is missing or an item on aisle {i} is out of stock."
        for i, what in enumerate(
            [
                "hammers, mallets and crowbars",
                "screwdrivers, drill bits and cordless drills",
                "wood screws, machine screws, nails and wall plugs",
                "hinges, handles and locks",
                "interior paint, primer, brushes and rollers",
                "exterior paint and wood stain",
                "timber, plywood, dowels and mouldings",
                "glue, sealant, tape and filler",
                "garden tools, hoses and watering cans",
                "seeds, compost, pots and fertiliser",
                "ladders, workbenches and storage boxes",
                "safety glasses, gloves and masks",
            ],
            start=1,
        )
    )
)  # a long system prompt every turn of a chat repeats: what prefix caching shares


def smol():
    """(model fp32 eval, tokenizer), loaded once per process (shared with the harness's
    real-model rows), or a skip when the model is not cached (run `make test`, whose set-up
    fetches it, or `python -m vmcache.models fetch`)."""
    from vmcache.bench import real

    if not real.available():
        pytest.skip("the embedded model is not cached; `make test` fetches it")
    return real.smol()


TINY_SHAPE = dict(num_hidden_layers=2, hidden_size=192, num_attention_heads=3,
                  num_key_value_heads=3, head_dim=64, intermediate_size=512)  # fmt: skip


@functools.cache
def tiny_chat():
    """(model fp32 eval, tokenizer): a random 2-layer model of the embedded model's family (its
    config, fewer and narrower layers: :data:`TINY_SHAPE`, seed 0) with its tokenizer and chat
    template, built once per process:
    the server's tests run on it (the same prompts and vocabulary, a fraction of the time); the
    trained model's own answers are tests/models/test_real_model.py's. A skip as :func:`smol`'s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _tiny_source()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(src)).eval()
    return model, AutoTokenizer.from_pretrained(src)


def _tiny_source():
    from vmcache.bench import real
    from vmcache.models import DEFAULT_MODEL, checkpoint_dir

    if not real.available():
        pytest.skip("the embedded model is not cached; `make test` fetches it")
    return checkpoint_dir(DEFAULT_MODEL, download=False)


def _tiny_config(src):
    import json

    from transformers import AutoConfig

    # the same K/V geometry (3 KV heads of 64: 768-byte rows, 256-token prefix blocks on
    # 64 KiB pages) and vocabulary; narrower layers and 2 of them, so that the lm_head over the
    # 49,152-token vocabulary (most of a step's time here) is a third of the trained model's
    return AutoConfig.for_model(**{**json.loads((src / "config.json").read_text()),
                                   **TINY_SHAPE})  # fmt: skip


def prompt(tokenizer, question: str, system: str | None = None) -> list[int]:
    from vmcache.bench.real import chat

    return chat(tokenizer, question, system)


def generate(model, ids: list[int], new: int, **kw) -> list[int]:
    """Greedy ``generate`` with DynamicCache on one unpadded prompt: the reference."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=new, **kw)  # fmt: skip
    return out[0, len(ids) :].tolist()


def tiny_chat_checkpoint(directory) -> str:
    """A checkpoint directory with the embedded model's tokenizer and chat template around a
    random 2-layer model of its family (:data:`TINY_SHAPE`): the harness's real-model
    rows run on it as on the trained model (chat prompts, the same vocabulary) in a fraction
    of the time; a skip when the embedded model is not cached."""
    import shutil
    from pathlib import Path

    src, dst = _tiny_source(), Path(directory)
    tiny_chat()[0].save_pretrained(dst)  # the same random model the server's tests run
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):  # fmt: skip
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return str(dst)
