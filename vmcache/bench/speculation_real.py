"""Speculative decoding on real tasks: the trained SmolLM2-135M-Instruct, greedy, chat prompts
where the answer quotes the prompt and where it does not.

TASKS: "quoting": repeat a paragraph, extract log lines, rename a variable in code, fix the
spelling of a text (the answer copies long runs of the prompt: where prompt lookup pays);
"open": questions whose answers are new text. SPECULATION: none; NgramDrafter(k=4) as a
chain and as a token tree of 3 chains (mask); a draft model, the target's first fifth of
its decoder layers (:func:`draft_layers`: 6 of SmolLM2's 30, at least one) with its own
embeddings and head (a truncated copy: about a fifth of a target step; no training), k=3, on
its own cache. ROWS: engine steps, generated
tokens per step (the batch's), drafts proposed and accepted (acceptance), tokens a
verification emitted per sequence, whether every answer equals the run without speculation
(greedy: it must), wall time (median of repeats, min-max) and its ratio to none. One
VMKVCache (layer_major, host backend) a run, all requests at once; CPU, 2 threads.
"""

from __future__ import annotations

import copy
import statistics
import time

from vmcache.bench.real import chat, row_name, smol
from vmcache.engine import DraftModel, Engine, NgramDrafter, Request, SamplingParams
from vmcache.models import DEFAULT_MODEL
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.spec import KVSpec

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed "
             "the wick, polished the great lens and wrote the weather in a leather book. Ships "
             "passing in the night never saw him, but they steered by his light.")  # fmt: skip
LOG = "\n".join(["12:00:01 INFO service started", "12:00:04 ERROR disk quota exceeded on /var",
                 "12:00:09 INFO request served in 12 ms", "12:00:15 ERROR timeout talking to db",
                 "12:00:20 INFO cache warmed",
                 "12:00:31 ERROR disk quota exceeded on /home"])  # fmt: skip
CODE = ("def mean(x):\n    s = 0\n    for v in x:\n        s = s + v\n    return s / len(x)\n\n"
        "def spread(x):\n    return max(x) - min(x)\n")  # fmt: skip
TYPOS = ("Teh quick brown fox jumpd over the lazy dog. It was a sunny day and evrything in the "
         "garden was quiet exept for the birds singing in the tres.")  # fmt: skip
TASKS = {
    "quoting": [
        f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}",
        f"Print only the ERROR lines of this log, unchanged:\n\n{LOG}",
        f"Rename the variable s to total in this code and print the whole code:\n\n{CODE}",
        f"Correct the spelling in this text and return the whole corrected text:\n\n{TYPOS}",
    ],
    "open": [
        "Why is the sky blue? Explain in a short paragraph.",
        "Give three tips for learning to cook.",
        "What makes a good friend? Answer in a few sentences.",
        "Describe a walk in a forest in autumn.",
    ],
}


def draft_layers(model) -> int:
    """The draft's depth: a fifth of the target's decoder layers, at least one."""
    return max(1, model.config.num_hidden_layers // 5)


def truncated_draft(model, layers: int):
    """The target's first ``layers`` decoder layers, its embeddings, final norm and head: a
    draft that shares the vocabulary and costs about layers / N_L of a target step."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft.eval()


def _cache(model, n: int, max_len: int) -> VMKVCache:
    spec = KVSpec.from_hf_config(model.config)
    return VMKVCache(spec, 2 * n, max_len, pool_bytes=2 * n * max_len * spec.bytes_per_token
                     + (64 << 20))  # fmt: skip


def _variants(model, n: int, max_len: int):
    yield "none", lambda: None
    yield "ngram k=4", lambda: NgramDrafter(k=4)
    yield "ngram tree 3x4 (mask)", lambda: NgramDrafter(k=4, branches=3)
    layers = draft_layers(model)
    draft = truncated_draft(model, layers)
    yield (f"draft model ({layers} of {model.config.num_hidden_layers} layers) k=3",
           lambda: DraftModel(draft, _cache(draft, n, max_len), k=3))  # fmt: skip


def rows(repeats: int = 3, new_tokens: int = 96, per_task: int | None = None,
         model_name: str = DEFAULT_MODEL) -> list[dict]:  # fmt: skip
    model, tok = smol(model_name)
    out = []
    for workload, asks in TASKS.items():
        asks = asks[:per_task] if per_task else asks
        prompts = [chat(tok, a) for a in asks]
        max_len = max(map(len, prompts)) + new_tokens + 16
        reqs = [Request(f"{workload}{i}", tuple(p), SamplingParams(max_new_tokens=new_tokens))
                for i, p in enumerate(prompts)]  # fmt: skip
        base_out, base_wall = None, None
        for name, make in _variants(model, len(reqs), max_len):
            walls, engine, got = [], None, None
            for _ in range(repeats):
                engine = Engine(model, _cache(model, len(reqs), max_len), speculative=make())
                t0 = time.perf_counter()
                got = engine.run(reqs)
                walls.append(time.perf_counter() - t0)
            st, sp = engine.stats, engine.stats.speculation
            wall = statistics.median(walls)
            if base_out is None:
                base_out, base_wall = got, wall
            row = {"model": row_name(model_name), "workload": workload, "speculation": name,
                   "requests": len(reqs), "new_tokens": new_tokens, "repeats": repeats,
                   "steps": st.steps, "generated_tokens": st.generated_tokens,
                   "tokens_per_step": st.generated_tokens / st.steps,
                   "spec_proposed": sp.proposed, "spec_accepted": sp.accepted,
                   "acceptance": sp.accepted / sp.proposed if sp.proposed else None,
                   "tokens_per_verify": (sp.accepted + sp.steps) / sp.steps
                   if sp.steps else None,
                   "answers_equal_none": got == base_out, "wall_s": wall,
                   "wall_s_min": min(walls), "wall_s_max": max(walls),
                   "wall_vs_none": wall / base_wall}  # fmt: skip
            out.append(row)
            print(f"  real {workload:8s} {name:34s} steps {st.steps:4d}  acceptance "
                  f"{row['acceptance'] or 0:.2f}  wall {wall:6.2f} s ({row['wall_vs_none']:.2f}x)",
                  flush=True)  # fmt: skip
    return out
