"""What each rank of tests/distributed/test_serve_distributed.py runs: the disaggregated engine
(rank 0 prefills, rank 1 decodes) and tensor parallelism (transformers' tp_plan load, KV heads
sharded), each against one process's engine."""

import copy

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from vmcache import KVSpec, VMKVCache
from vmcache.distributed.disagg import serve_disaggregated
from vmcache.distributed.tp import load_tp_model, shard_spec, tensor_parallel_engine
from vmcache.engine import Engine, NgramDrafter, Request, SamplingParams
from vmcache.paged_fallback import PagedKVCache

CFG = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip
SPEC = KVSpec.from_hf_config(CFG)


def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(copy.deepcopy(CFG)).eval()


def cache(kind, spec=SPEC, pages=40, max_seqs=8):
    if kind == "vm":  # 4 KiB pages: 32 tokens of one layer's K (or V) per page
        return VMKVCache(spec, max_seqs, 128, page_size=4096, pool_bytes=pages * 4096)
    if kind == "vm_token_major":
        return VMKVCache(spec, max_seqs, 128, page_size=4096, pool_bytes=pages * 4096,
                         layout="token_major")  # fmt: skip
    return PagedKVCache(spec, num_blocks=pages, block_size=16, max_seq_len=128,
                        max_seqs=max_seqs)  # fmt: skip


def requests(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = lambda n: tuple(torch.randint(0, 128, (n,), generator=g).tolist())  # noqa: E731
    shape = [(40, 12), (9, 20), (70, 6), (23, 1), (31, 16), (12, 24), (55, 9), (17, 14)]
    reqs = [Request(f"r{i}", prompt(n), SamplingParams(max_new_tokens=m))
            for i, (n, m) in enumerate(shape)]  # fmt: skip
    reqs.append(Request("forks", prompt(21), SamplingParams(max_new_tokens=10, n=3)))
    reqs.append(Request("sampled", prompt(15), SamplingParams(max_new_tokens=12, n=2,
                                                             temperature=0.8, seed=5)))  # fmt: skip
    return reqs


# decode pools small enough that hand-offs are refused and the decode worker preempts
DISAGG = [("vm", 40, 24), ("vm_token_major", 40, 16), ("paged", 48, 16)]


def disagg(rank: int) -> dict:
    m = model()
    out = {}
    for kind, prefill_pages, decode_pages in DISAGG:
        for packed in (False, True) if kind == "paged" else (False,):
            pages = prefill_pages if rank == 0 else decode_pages
            engine = Engine(m, cache(kind, pages=pages), max_batch_tokens=48)
            got = serve_disaggregated(engine, requests(), packed=packed)
            res = {"outputs": got, "log": engine.handoff_log.as_dict(),
                   "left": engine.kv._pool.num_used, "stats": engine.stats.as_dict()}  # fmt: skip
            if rank == 0:
                ref = Engine(m, cache(kind, pages=prefill_pages), max_batch_tokens=48)
                res["single"] = ref.run(requests())
            out[(kind, packed)] = res
    # speculation on the decode worker (prompt lookup): greedy outputs must not change
    pages = 40 if rank == 0 else 24
    engine = Engine(m, cache("vm", pages=pages), max_batch_tokens=48,
                    speculative=NgramDrafter(k=4) if rank == 1 else None)  # fmt: skip
    got = serve_disaggregated(engine, requests())
    out["speculative"] = {"outputs": got, "left": engine.kv._pool.num_used,
                          "stats": engine.stats.as_dict()}  # fmt: skip
    return out


def tp(rank: int, ckpt: str) -> dict:
    world = dist.get_world_size()
    sharded = load_tp_model(ckpt)
    spec = shard_spec(KVSpec.from_hf_config(sharded.config), world)
    out = {"spec": (spec.num_kv_heads, spec.q_heads)}
    for kind in ("vm", "paged"):
        pages = 24 if kind == "vm" else 10  # small enough to preempt
        engine = tensor_parallel_engine(sharded, cache(kind, spec, pages), max_batch_tokens=32)
        tables = []
        real_step = engine.step

        def step(engine=engine, tables=tables, real_step=real_step):
            real_step()
            kv = engine.kv
            tables.append({s: (kv.seq_len(s), kv.views.page_table(s)) for s in kv.sequences})

        engine.step = step
        out[kind] = {"outputs": engine.run(requests()), "tables": tables,
                     "preempted": engine.stats.preempt_recompute}  # fmt: skip
        # one packed step's logits, compared with one process's below
        probe = requests(1)[:3]
        c = cache(kind, spec, pages=24)
        runner = tensor_parallel_engine(sharded, c).runner
        slots = [c.new_sequence() for _ in probe]
        for s, r in zip(slots, probe):
            c.grow(s, len(r.prompt))
        out[kind]["logits"] = runner.step(slots, [0] * 3, [list(r.prompt) for r in probe])
    if rank == 0:
        whole = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        for kind in ("vm", "paged"):
            out[kind]["single"] = Engine(whole, cache(kind, pages=48),
                                         max_batch_tokens=32).run(requests())  # fmt: skip
            c = cache(kind, pages=48)
            runner = Engine(whole, c).runner
            probe = requests(1)[:3]
            slots = [c.new_sequence() for _ in probe]
            for s, r in zip(slots, probe):
                c.grow(s, len(r.prompt))
            out[kind]["single_logits"] = runner.step(slots, [0] * 3,
                                                     [list(r.prompt) for r in probe])  # fmt: skip
    return out
