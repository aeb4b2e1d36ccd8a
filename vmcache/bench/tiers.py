"""Prefix tiers measured: a multi-turn trace whose working set exceeds device memory, served
by the engine with prefix caching and no tier, a host-RAM tier, a disk tier, or both.

    python -m vmcache.bench --mode tiers [--quick] [--repeats 3]     (make bench-tiers)

TRACE: --conversations conversations (default 32) of --turns turns (4), served a round at a
time (turn t of every conversation, all arriving at once; turn t+1 needs turn t's answer):
a 32-token system prompt shared by all, then per turn a 48-token user message and a 16-token
greedy answer; turn t's prompt is the whole history. At turn 4 one conversation is 272
tokens, all 32 about 8,700, while the device pool holds 2,048 tokens: most of a history is
evicted before its next turn comes, so without a tier it is prefilled again.

MODEL AND CACHES: a seeded random Llama (4 layers, 2 KV heads of 32, fp32: 2 KiB of K/V a
token) on the CPU; VMKVCache (layer_major, 4 KiB pages = 16 tokens of one layer's K or V,
host backend) and PagedKVCache (16-token blocks), both with 2,048 tokens of pool. Tiers:
"host" 64 MiB of RAM (holds everything); "disk" files under a temporary directory, 256 MiB;
"host+disk" 4 MiB of RAM (about a fifth of the working set) over the disk.

REFERENCE: "none, 8x pool" is a device pool of 16,384 tokens, which holds the whole working
set: the hit rate no eviction spoils, which the tiers should reach.

ROWS: prompt tokens, tokens served by the prefix index (device and tiers), prefill tokens
computed, tokens saved against no tier, hit rate, pages promoted from each tier, disk files
and bytes written and read, device copies (down and up) and the pages and KiB one moves, wall
time (median of --repeats,
min-max), and whether every answer equals the no-tier run's (promoted K/V are the bytes that
were computed, so greedy answers should not change).

On this machine the model is tiny and the CPU computes it: the wall time says what moving
K/V through RAM and disk costs against recomputing it with a small model, not with an 8B one
on a GPU, where prefill costs far more per token. The token counts do not depend on the
machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from vmcache.bench.common import add_out_arg, add_threads_arg, save_and_plot, table, torch_threads
from vmcache.memory.backends.host import HostBackend
from vmcache.paged_fallback import PagedKVCache
from vmcache.prefix.tiers import PrefixTiers
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.spec import KVSpec

POOL_TOKENS, SYSTEM, USER, ANSWER, VOCAB = 2048, 32, 48, 16, 512
TIERS = ("none", "host", "disk", "host+disk", "none, 8x pool")  # the last: the reference
MiB = 1 << 20


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def make_tiers(which: str, directory: str) -> PrefixTiers | None:
    if which.startswith("none"):
        return None
    if which == "host":
        return PrefixTiers(64 * MiB)
    if which == "disk":
        return PrefixTiers(disk_dir=directory, disk_bytes=256 * MiB)
    return PrefixTiers(4 * MiB, disk_dir=directory, disk_bytes=256 * MiB)


def make_cache(kind: str, spec: KVSpec, tiers, max_len: int, pool_tokens: int):
    if kind == "vm":
        page = 4096
        pages = pool_tokens * spec.bytes_per_token // page
        return VMKVCache(spec, 64, max_len, page_size=page, pool_bytes=pages * page,
                         backend=HostBackend(), prefix_caching=True,
                         prefix_tiers=tiers)  # fmt: skip
    return PagedKVCache(spec, num_blocks=pool_tokens // 16, block_size=16, max_seq_len=max_len,
                        max_seqs=64, prefix_caching=True, prefix_tiers=tiers)  # fmt: skip


def run(kind: str, which: str, m, conversations: int, turns: int,
        pool_tokens: int = POOL_TOKENS) -> dict:  # fmt: skip
    from vmcache.engine import Engine, Request, SamplingParams

    spec = KVSpec.from_hf_config(m.config)
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, VOCAB, (SYSTEM,), generator=g).tolist()
    history = [list(system) for _ in range(conversations)]
    answers: list[list[int]] = []
    with tempfile.TemporaryDirectory() as d:
        tiers = make_tiers(which, d)
        pool = pool_tokens * (8 if which.endswith("8x pool") else 1)
        kv = make_cache(kind, spec, tiers, SYSTEM + turns * (USER + ANSWER), pool)
        engine = Engine(m, kv, max_batch_tokens=1024)
        prompt_tokens = 0
        t0 = time.perf_counter()
        for t in range(turns):
            reqs = []
            for c in range(conversations):
                history[c] += torch.randint(0, VOCAB, (USER,), generator=g).tolist()
                prompt_tokens += len(history[c])
                reqs.append(Request(f"{c}-{t}", tuple(history[c]),
                                    SamplingParams(max_new_tokens=ANSWER)))  # fmt: skip
            out = engine.run(reqs)
            for c in range(conversations):
                (answer,) = out[f"{c}-{t}"]
                history[c] += answer
                answers.append(answer)
        wall = time.perf_counter() - t0
        st, ps = engine.stats, kv.prefix.index.stats()
        ts, page_bytes = kv.prefix.tier_stats(), kv.config.page_bytes
        kv.close()
    row = {"cache": kind, "tiers": which, "pool_tokens": pool, "wall_s": wall,
           "prompt_tokens": prompt_tokens,
           "hit_tokens": st.prefix_hit_tokens, "tier_hit_tokens": ps.tier_hit_tokens,
           "prefill_tokens": st.prefill_tokens, "hit_rate": st.prefix_hit_tokens / prompt_tokens,
           "preempted": st.preempt_recompute, "answers": answers}  # fmt: skip
    if ts is not None:
        row.update({k: getattr(ts, k) for k in ("demoted_pages", "promoted_host_pages",
                    "promoted_disk_pages", "disk_files_written", "disk_files_read",
                    "disk_bytes_written", "disk_bytes_read", "device_copies")})  # fmt: skip
        moved = ts.demoted_pages + ts.promoted_host_pages + ts.promoted_disk_pages
        row["pages_per_device_copy"] = moved / max(ts.device_copies, 1)
        row["kib_per_device_copy"] = row["pages_per_device_copy"] * page_bytes / 1024
    return row


def rows_for(kind: str, m, repeats: int, conversations: int, turns: int) -> list[dict]:
    rows = []
    for which in TIERS:
        runs = [run(kind, which, m, conversations, turns) for _ in range(repeats)]
        row = dict(runs[0])
        walls = [r["wall_s"] for r in runs]
        row["wall_s"] = statistics.median(walls)
        row["wall_s_min"], row["wall_s_max"] = min(walls), max(walls)
        row["repeats"] = repeats
        row["same_every_repeat"] = all(r["answers"] == runs[0]["answers"] for r in runs)
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["saved_prefill_tokens"] = base["prefill_tokens"] - row["prefill_tokens"]
        same = sum(a == b for a, b in zip(row["answers"], base["answers"]))
        row["answers_equal_no_tier"] = same
        row["answers_total"] = len(base["answers"])
    for row in rows:
        del row["answers"]
        print(kind, row["tiers"], {k: row[k] for k in ("hit_rate", "prefill_tokens", "wall_s")})
    return rows


COLUMNS = ["cache", "tiers", "hit_rate", "prefill_tokens", "saved_prefill_tokens",
           "promoted_host_pages", "promoted_disk_pages", "disk_files_read",
           "kib_per_device_copy", "wall_s"]  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 16 conversations, 3 turns")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    add_out_arg(ap)
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    with torch_threads(args.threads):
        return _run(args)


def _run(args):
    m = model()
    conv, turns = (16, 3) if args.quick else (args.conversations, args.turns)
    reps = 1 if args.quick else args.repeats
    rows = rows_for("vm", m, reps, conv, turns) + rows_for("paged", m, reps, conv, turns)
    print(table(rows, COLUMNS))
    extra = {"pool_tokens": POOL_TOKENS, "conversations": conv, "turns": turns,
             "system_tokens": SYSTEM, "user_tokens": USER, "answer_tokens": ANSWER}  # fmt: skip
    save_and_plot("tiers", torch.device("cpu"), rows, extra, args.out, plot)
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, kind in enumerate(("vm", "paged")):
        rs = [r for r in rows if r["cache"] == kind]
        x = range(len(rs))
        axes[0].bar([j + 0.4 * i for j in x], [r["prefill_tokens"] for r in rs], 0.4, label=kind)
        axes[1].bar([j + 0.4 * i for j in x], [r["wall_s"] for r in rs], 0.4, label=kind)
    for ax, label in zip(axes, ("prefill tokens computed", "wall time (s)")):
        ax.set_xticks([j + 0.2 for j in range(len(TIERS))], TIERS)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("multi-turn trace, working set > device pool: prefix tiers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
