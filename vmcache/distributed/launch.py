"""Serve requests over several processes: disaggregated prefill → decode, or tensor parallel.

    python -m vmcache.distributed.launch --mode disagg [--cache vm|vm_token_major|paged] [options]
    python -m vmcache.distributed.launch --mode tp --nproc 2 [options]
    torchrun --nproc_per_node 2 -m vmcache.distributed.launch --mode disagg [options]

Without torchrun's environment (RANK, WORLD_SIZE, ...) it starts ``--nproc`` processes itself
(forked from a server that imported the engine once: :mod:`.forkserver`) and joins them in a
process group: NCCL when there is a CUDA GPU per process, else gloo on the CPU. ``--model PATH`` is
a local transformers checkpoint of a Llama-family model; without it, a small random Llama is
built (seeded; the same on every rank) and, for tensor parallelism, saved to a temporary
directory first (transformers' sharded load reads a checkpoint). Rank 0 prints one JSON line
with every rank's report: the outputs' digest, hand-off messages and bytes, engine
statistics; ``--check`` also runs one process's engine on rank 0 and reports whether every
greedy output is the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m vmcache.distributed.launch", description=__doc__.split("\n")[0]
    )
    p.add_argument("--mode", choices=("disagg", "tp"), default="disagg")
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn (without torchrun)")
    p.add_argument("--cache", choices=("vm", "vm_token_major", "paged"), default="vm")
    p.add_argument("--model", default=None,
                   help="what vmcache.models.load takes: an embedded name (smollm2-135m-instruct), "
                        "a checkpoint directory or a .gguf file (tp: not a .gguf); default: a "
                        "random Llama")  # fmt: skip
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--pool-mib", type=float, default=4.0, help="KV pool per process")
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--packed", action="store_true", help="paged: one gathered message a table")
    p.add_argument("--check", action="store_true", help="compare with one process's engine")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def build_cache(kind: str, spec, args, device):
    from vmcache.paged_fallback import PagedKVCache
    from vmcache.sequences.cache import VMKVCache

    pool = int(args.pool_mib * 2**20)
    max_len = args.prompt_len + args.max_new_tokens
    if kind == "paged":
        return PagedKVCache(spec, pool_bytes=pool, block_size=16, max_seq_len=max_len,
                            max_seqs=32, device=device)  # fmt: skip
    layout = "token_major" if kind == "vm_token_major" else "layer_major"
    page = 64 * 1024 if device.type == "cpu" else None  # the CUDA default is 2 MiB
    return VMKVCache(spec, 32, max_len, device, page_size=page, pool_bytes=pool, layout=layout)


def make_requests(args, vocab: int):
    from vmcache.engine import Request, SamplingParams

    g = torch.Generator().manual_seed(args.seed)
    return [Request(f"r{i}", tuple(torch.randint(0, vocab, (args.prompt_len,), generator=g)
                                   .tolist()), SamplingParams(max_new_tokens=args.max_new_tokens))
            for i in range(args.requests)]  # fmt: skip


def digest(outputs: dict) -> str:
    return hashlib.sha256(json.dumps(sorted(outputs.items())).encode()).hexdigest()[:16]


def worker(args) -> dict:
    """One rank's part (the process group already initialised)."""
    from vmcache.engine import Engine
    from vmcache.sequences.spec import KVSpec

    rank = dist.get_rank()
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if args.mode == "tp":
        from vmcache.distributed.tp import load_tp_model, shard_spec, tensor_parallel_engine

        model = load_tp_model(args.model)
        spec = shard_spec(KVSpec.from_hf_config(model.config), dist.get_world_size())
        engine = tensor_parallel_engine(model, build_cache(args.cache, spec, args, device),
                                        max_batch_tokens=args.max_batch_tokens)  # fmt: skip
        reqs = make_requests(args, model.config.vocab_size)
        outputs = engine.run(reqs)
        log = {}
    else:
        from vmcache.distributed.disagg import serve_disaggregated

        model = (_load(args.model) if args.model else tiny_llama(args.seed)).to(device)
        spec = KVSpec.from_hf_config(model.config)
        engine = Engine(model, build_cache(args.cache, spec, args, device),
                        max_batch_tokens=args.max_batch_tokens)  # fmt: skip
        reqs = make_requests(args, model.config.vocab_size)
        outputs = serve_disaggregated(engine, reqs, packed=args.packed)
        log = engine.handoff_log.as_dict()
    report = {"rank": rank, "mode": args.mode, "cache": args.cache, "backend": dist.get_backend(),
              "requests": len(reqs), "digest": digest(outputs), "handoff": log,
              "engine": engine.stats.as_dict()}  # fmt: skip
    if args.check and rank == 0:
        whole = (_load(args.model) if args.model else tiny_llama(args.seed)).to(device)
        spec = KVSpec.from_hf_config(whole.config)
        ref = Engine(whole, build_cache(args.cache, spec, args, device),
                     max_batch_tokens=args.max_batch_tokens)  # fmt: skip
        report["equal_to_one_process"] = ref.run(reqs) == outputs
    return report


def _load(name_or_path):
    """The model ``--model`` names, fp32, eval: a checkpoint directory's model alone (the
    launcher's requests are token ids: no tokenizer is needed, and the random model ``--mode
    tp`` saves has none), anything else through :func:`vmcache.models.load`."""
    if os.path.isdir(name_or_path):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32).eval()
    from vmcache.models import load

    return load(name_or_path, dtype=torch.float32)[0]


def rank_device(local_rank: int, world: int) -> tuple[str, torch.device | None]:
    """(backend, device) of one rank: NCCL with the rank's own GPU (set as the current device
    before the group exists: without it every rank of a node lands on cuda:0) when there is a
    GPU per local rank, else gloo on the CPU."""
    count = torch.cuda.device_count()
    if count >= world and local_rank < count:
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", None


def cpu_threads(world: int) -> int:
    """Torch threads of each of ``world`` ranks on this machine's CPU: its cores shared out
    (each rank's default, every core, oversubscribed them ``world`` times over)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world)


def _rank_main(rank: int, world: int, init: str, args, spawned: bool = False) -> None:
    local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun's; our own spawn sets it below
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world))
    backend, device_id = rank_device(local, world)
    if spawned and device_id is None:  # ranks on the CPU: its cores shared out among them
        torch.set_num_threads(cpu_threads(world))
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            device_id=device_id)  # fmt: skip
    try:
        reports: list = [None] * world
        dist.all_gather_object(reports, worker(args))
        if rank == 0:
            print(json.dumps({"world": world, "ranks": reports}), flush=True)
        dist.barrier()  # no rank tears its connections down while another still uses them
    except BaseException:
        dist.destroy_process_group()
        raise
    if spawned:
        # Our own worker process, its work done and reported: end it here. Tearing gloo down
        # (destroy_process_group, then the interpreter's exit) while the other rank closes
        # its side ended a rank with std::terminate about once in twenty runs under load.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nproc < 2:
        raise SystemExit("--nproc must be at least 2")
    with tempfile.TemporaryDirectory() as tmp:
        if args.mode == "tp" and args.model is None:  # the sharded load reads a checkpoint
            tiny_llama(args.seed).save_pretrained(tmp)
            args.model = tmp
        elif args.mode == "tp":  # an embedded name: its converted copy, made once, not per rank
            from vmcache.models import checkpoint_dir

            args.model = str(checkpoint_dir(args.model))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
            world = int(os.environ["WORLD_SIZE"])
            _rank_main(int(os.environ["RANK"]), world, "env://", args)
            return 0
        import torch.multiprocessing as mp

        from vmcache.distributed import forkserver

        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        forkserver.context()  # ranks forked from a server that imported the engine once
        mp.start_processes(_rank_main, args=(args.nproc, init, args, True), nprocs=args.nproc,
                           start_method="forkserver")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
