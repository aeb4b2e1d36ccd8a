"""Continuous batching over either cache: requests in, token lists out, nothing dropped.

    engine = Engine(model, VMKVCache(spec, max_seqs=32, max_seq_len=2048, pool_bytes=...))
    outputs = engine.run([Request("a", prompt_ids, SamplingParams(max_new_tokens=64))])
    outputs["a"]  # n lists of generated token ids

A step: schedule (grow = the map phase, preemption if the pool is short) → one packed model
step for every scheduled sequence (prefills and decodes together) → sample → finish or fork.
A request with ``n > 1`` is prefilled once; its other sequences are forks (copy-on-write).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from vmcache.engine import tree
from vmcache.engine.request import Request, SamplingParams, Seq, Status, model_eos_ids
from vmcache.engine.runner import ModelRunner
from vmcache.engine.scheduler import Scheduler
from vmcache.engine.speculative import DraftModel, NgramDrafter, sample, verify_tree
from vmcache.errors import CacheFull


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens fed in prefills (recomputed ones included)
    generated_tokens: int = 0
    preempt_swap: int = 0
    preempt_recompute: int = 0
    swap_bytes: int = 0  # bytes copied to the host tier by swap-outs
    recompute_tokens: int = 0  # tokens whose K/V were dropped and computed again
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix index
    prefix_waits: int = 0  # admissions deferred a step to hit a prefix being prefilled
    map_s: float = 0.0  # time in the schedule phase (grows map what was not mapped ahead)
    premap_s: float = 0.0  # time mapping next-step pages while the step runs (map_ahead)
    premapped_pages: int = 0
    model_s: float = 0.0  # time in model steps
    elapsed_s: float = 0.0
    max_running: int = 0
    released_pages: int = 0  # free pages' memory given back (keep_free_pages)
    budget_waits: int = 0  # steps with nothing to run while a shared budget was taken
    spec_steps: int = 0  # sequence-steps that verified drafts
    spec_proposed: int = 0  # draft tokens fed to the target
    spec_accepted: int = 0  # of them, accepted
    spec_rolled_back: int = 0  # rejected draft tokens whose K/V were truncated away
    spec_mapped_pages: int = 0  # page-table entries verifications mapped (forks' included)
    tree_steps: int = 0  # verifications of a token tree (more than one chain)
    tree_branches: int = 0  # chains beyond the first that token trees verified
    tree_wins: int = 0  # tree verifications a chain other than the first won
    tree_copied_bytes: int = 0  # K/V bytes copied for trees: forks' CoW, or mask compaction
    step_s: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("step_s")
        steps = max(self.steps, 1)
        rate = self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0
        d.update(map_ms_per_step=1e3 * self.map_s / steps, step_ms=1e3 * self.model_s / steps,
                 premap_ms_per_step=1e3 * self.premap_s / steps, tok_per_s=rate,
                 spec_acceptance=self.spec_accepted / max(self.spec_proposed, 1))  # fmt: skip
        return d


class Engine:
    def __init__(self, model, cache, *, preemption: str = "recompute", victim: str = "last",
                 max_batch_tokens: int = 2048, map_ahead: bool = True,
                 keep_free_pages: int | None = None,
                 speculative: NgramDrafter | DraftModel | None = None) -> None:  # fmt: skip
        """``keep_free_pages``: after each step, give back the memory of free pages beyond
        that many (elastic memory: an engine sharing a device's budget returns what it does
        not use); None keeps every page it created. ``speculative``: draft tokens for every
        decoding sequence and verify them in the next step
        (:mod:`vmcache.engine.speculative`); a sliding-window cache must keep
        ``rollback_tokens`` ≥ its ``k`` (a rejected draft is truncated away).

        Sequences stop at the model's end-of-sequence ids (:attr:`eos_token_ids`, read from
        its ``generation_config`` here) unless a request says ``ignore_eos``; why each
        finished is in :attr:`finish_reasons`."""
        if speculative is not None:
            if not isinstance(speculative, (NgramDrafter, DraftModel)):
                raise TypeError(f"speculative must be an NgramDrafter or a DraftModel, got "
                                f"{type(speculative).__name__}")  # fmt: skip
            if isinstance(speculative, DraftModel):
                vocab = model.config.get_text_config().vocab_size
                if speculative.vocab != vocab or speculative.kv is cache:
                    why = f"({speculative.vocab} vs {vocab})"
                    raise ValueError(f"a draft model needs the target's vocabulary {why} "
                                     "and its own cache")  # fmt: skip
            if speculative.branches > 1 and any(g.sliding for g in cache.groups):
                raise ValueError("token trees (branches > 1) are not supported with sliding "
                                 "windows: a branch forks back past the draft margin")  # fmt: skip
            margin = min((g.rollback_tokens for g in cache.groups if g.sliding), default=None)
            if margin is not None and margin < speculative.k:
                raise ValueError(f"a sliding-window cache with rollback_tokens={margin} cannot "
                                 f"take back a rejected draft of {speculative.k} tokens: build "
                                 f"it with rollback_tokens >= {speculative.k}")  # fmt: skip
        self.speculative = speculative
        self.kv = cache
        self.map_ahead = map_ahead
        self.keep_free_pages = keep_free_pages
        self.max_wait_s = 60.0  # on a shared budget: how long nothing may run before CacheFull
        self._stalled_since: float | None = None
        self.runner = ModelRunner(model, cache)
        self.vocab = model.config.get_text_config().vocab_size
        self.eos_token_ids = model_eos_ids(model)  # stop ids of every request but ignore_eos
        self.scheduler = Scheduler(cache, preemption, victim, max_batch_tokens)
        self.stats = EngineStats()
        self.outputs: dict[str, list[list[int] | None]] = {}  # req_id -> n token lists
        self.finish_reasons: dict[str, list[str | None]] = {}  # req_id -> "stop" / "length"
        self._pending_forks: dict[str, int] = {}  # req_id -> sequences still to create
        self.times: dict[str, list] = {}  # req_id -> [arrival, first token, finish] (perf_counter)
        # called with (seq, its forked siblings) once a prompt is prefilled and sampled, for
        # those still running (vmcache.distributed.disagg hands them to a decode worker)
        self.on_prefilled: Callable[[Seq, list[Seq]], None] | None = None

    def add_request(self, req: Request, arrival_s: float | None = None) -> None:
        """Queue a request (arrived at ``arrival_s``, a ``time.perf_counter()`` value; now by
        default); bad input raises here, before anything changes."""
        if not isinstance(req, Request):
            raise TypeError(f"add_request takes a Request, got {type(req).__name__}")
        if req.req_id in self.outputs:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        prompt = list(req.prompt)
        if not prompt or not all(isinstance(t, int) and 0 <= t < self.vocab for t in prompt):
            raise ValueError(f"request {req.req_id!r}: prompt must be a non-empty list of token "
                             f"ids in [0, {self.vocab})")  # fmt: skip
        if any(t >= self.vocab for t in req.params.stop_token_ids):
            raise ValueError(f"request {req.req_id!r}: stop_token_ids must be below the "
                             f"vocabulary size {self.vocab}")  # fmt: skip
        total = len(prompt) + req.params.max_new_tokens
        if total > self.kv.max_seq_len:
            raise ValueError(f"request {req.req_id!r}: {total} tokens exceed the cache's "
                             f"max_seq_len {self.kv.max_seq_len}")  # fmt: skip
        # a sliding window holds only its last pages: the peak of a grow by one step (a whole
        # prefill or re-prefill chunk) is what must fit
        peak = self.kv.memory.peak_pages(total, min(total, self.scheduler.max_batch_tokens))
        if peak > self.kv.pool.num_pages:
            raise ValueError(f"request {req.req_id!r}: {total} tokens need {peak} pages at "
                             f"once, the pool has {self.kv.pool.num_pages}")  # fmt: skip
        self.outputs[req.req_id] = [None] * req.params.n
        self.finish_reasons[req.req_id] = [None] * req.params.n
        self.times[req.req_id] = [time.perf_counter() if arrival_s is None else arrival_s,
                                  None, None]  # fmt: skip
        self._pending_forks[req.req_id] = req.params.n - 1
        self.scheduler.waiting.append(self._seq(req, 0, prompt))

    def _seq(self, req: Request, index: int, tokens: list[int]) -> Seq:
        p = req.params
        g = torch.Generator().manual_seed(p.seed * 1_000_003 + index)
        stops = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        return Seq(req, index, list(tokens), g, stop_ids=stops)

    def _sample(self, logits: torch.Tensor, seq: Seq) -> int:
        p: SamplingParams = seq.req.params
        return sample(logits, p.temperature, p.top_k, seq.generator, p.top_p, p.min_p)

    def _append(self, seq: Seq, token: int, in_tokens: bool = False) -> None:
        """``token`` generated for ``seq`` (``in_tokens``: an accepted draft, already at the
        end of its tokens); a finished sequence is freed."""
        if not in_tokens:
            seq.tokens.append(token)
        seq.generated.append(token)
        self.stats.generated_tokens += 1
        reason = seq.done()
        if reason is not None:
            seq.finish_reason = reason
            self.finish_reasons[seq.req.req_id][seq.index] = reason
            self.kv.free(seq.slot)
            self.scheduler.running.remove(seq)
            seq.slot, seq.status = None, Status.FINISHED
            out = self.outputs[seq.req.req_id]
            out[seq.index] = seq.generated
            if all(o is not None for o in out):
                self.times[seq.req.req_id][2] = time.perf_counter()

    def _fork_siblings(self, seq: Seq, logits: torch.Tensor) -> list[Seq]:
        """After a request's prefill: its other n−1 sequences share the prompt's pages
        (returned: those that got a slot)."""
        rid = seq.req.req_id
        want = self._pending_forks.pop(rid, 0)
        if not want:
            return []
        sched = self.scheduler
        free_slots = self.kv.max_seqs - len(self.kv.sequences)
        kids = self.kv.fork(seq.slot, min(want, free_slots)) if free_slots else []
        forked = []
        for i in range(1, want + 1):
            sib = self._seq(seq.req, i, seq.tokens)
            if i <= len(kids):  # shares the prompt's pages, samples from the same logits
                sib.slot, sib.cached = kids[i - 1], seq.cached
                sib.status, sib.admitted_at = Status.RUNNING, seq.admitted_at
                sched.running.append(sib)
                forked.append(sib)
                self._append(sib, self._sample(logits, sib))
            else:  # no slot left: it waits and is prefilled on its own later
                sched.waiting.append(sib)
        return forked

    def _draft(self) -> None:
        """Append draft tokens to every decoding sequence (``seq.draft`` of them): a chain,
        or a token tree (``seq.tree`` for the mask way, ``seq.branches`` for forks)."""
        drafter, items = self.speculative, []
        drafter.forget(self.scheduler.running)
        for seq in self.scheduler.running:
            if seq.generated and len(seq.pending) == 1 and not seq.draft:
                p = seq.req.params
                room = min(p.max_new_tokens - len(seq.generated) - 1,
                           self.kv.max_seq_len - len(seq.tokens))  # fmt: skip
                seq.spec_k = drafter.next_k(seq.spec_k, seq.spec_accepted)
                seq.mapped_at_draft = self.kv.mapped_pages(seq.slot)
                items.append((seq, min(room, seq.spec_k)))
        if drafter.branches == 1:
            for (seq, _), d in zip(items, drafter.draft(items)):
                seq.tokens += d
                seq.draft = len(d)
            return
        for seq, limit in items:  # one search: its first chain is the main draft
            chains = drafter.tree(seq.tokens, limit)
            if drafter.tree_mode == "fork" or len(chains) < 2:
                d, seq.branches = (chains[0] if chains else []), chains[1:]
            else:  # the whole tree in the sequence's range, if it fits there
                d, parents = tree.flatten(chains)
                if len(seq.tokens) + len(d) <= self.kv.max_seq_len:
                    seq.tree = parents
                else:
                    d = chains[0]
            seq.tokens += d
            seq.draft = len(d)

    def _verify(self, seq: Seq, rows: torch.Tensor, forks=None) -> None:
        """Walk ``seq``'s scheduled drafts (a chain or a tree, ``forks``: its branches' forks
        and rows) with the target's ``rows``, keep the accepted path (moved into place for a
        tree mask; a fork's tables taken), roll the rest back (truncate: pages past it
        unmapped, nothing copied), emit one token."""
        st, p, kv = self.stats, seq.req.params, self.kv
        base = seq.cached  # the position of the token before the drafts
        nodes = seq.tokens[base : base + seq.chunk]  # root + the drafts this step fed
        parents = seq.tree[: seq.chunk] if seq.tree else list(range(-1, len(nodes) - 1))
        seq.tokens, seq.draft, seq.tree = seq.tokens[: base + seq.chunk], 0, None
        q = self.speculative.draft_probs(seq)
        q = None if q is None else [None, *q[: len(nodes) - 1]]
        owner, mapped = [0] * len(nodes), kv.mapped_pages(seq.slot)
        if forks:
            kids, kid_rows = forks
            mapped += sum(kv.mapped_pages(kid) for kid, _ in kids)
            nodes, parents, rows, owner = tree.with_forks(nodes, parents, rows, kids, kid_rows)
        path, token = verify_tree(rows, nodes, parents, p.temperature, p.top_k, seq.generator,
                                  q, p.top_p, p.min_p)  # fmt: skip
        accepted = len(path)
        seq.spec_accepted = accepted if len(nodes) > 1 else seq.spec_accepted
        chains = parents.count(0)  # chains hang from the root
        if chains > 1:
            st.tree_steps += 1
            st.tree_branches += 0 if forks else chains - 1  # forks: counted as they fork
        if forks:
            win = tree.settle_forks(kv, seq, path, owner, forks[0])
            st.tree_wins += bool(win)
        elif path != list(range(1, accepted + 1)):  # off the first chain: move it into place
            st.tree_copied_bytes += kv.beams.compact(seq.slot, base + 1,
                                                     [base + j for j in path])  # fmt: skip
            st.tree_wins += 1
            seq.tokens[base + 1 : base + 1 + accepted] = [nodes[j] for j in path]
        keep = base + 1 + accepted
        if kv.seq_len(seq.slot) > keep:
            st.spec_rolled_back += kv.seq_len(seq.slot) - keep
            kv.beams.truncate(seq.slot, keep)
        self.speculative.rolled_back(seq, keep)
        del seq.tokens[keep:]
        seq.cached = keep
        st.spec_steps += 1
        st.spec_mapped_pages += mapped - seq.mapped_at_draft
        st.spec_proposed += len(nodes) - 1
        st.spec_accepted += accepted
        for i in range(accepted):
            self._append(seq, seq.tokens[base + 1 + i], in_tokens=True)
            if seq.status is Status.FINISHED:
                return
        self._append(seq, token)

    def step(self) -> None:
        st, sched = self.stats, self.scheduler
        t0 = time.perf_counter()
        if self.speculative is not None:
            self._draft()
        batch = sched.schedule(st.steps)
        if self.speculative is not None:
            for seq in sched.running:  # drafts that did not get into this step
                if seq.draft and seq not in batch:
                    seq.drop_draft()
        t1 = time.perf_counter()
        if not batch:
            # a budget shared with other processes frees up as they finish: wait, not fail
            self._stalled_since = t0 if self._stalled_since is None else self._stalled_since
            if not self.kv.pool.shared_budget or t0 - self._stalled_since > self.max_wait_s:
                raise CacheFull("nothing can run: the pool cannot hold the next waiting "
                                "request", wanted=1, free=0)  # fmt: skip
            st.budget_waits += 1
            time.sleep(0.002)
            return
        self._stalled_since = None
        spec = [bool(s.draft) for s in batch]  # verifying drafts: every position's logits
        decodes = [sp or (bool(s.generated) and s.chunk == 1 and s.cached == len(s.tokens) - 1)
                   for s, sp in zip(batch, spec)]  # fmt: skip
        st.prefill_tokens += sum(s.chunk for s, d in zip(batch, decodes) if not d)
        rows = [s.chunk if sp else 1 for s, sp in zip(batch, spec)]
        args = ([s.slot for s in batch], [s.cached for s in batch], [s.scheduled for s in batch])
        forks = tree.fork_all(self.kv, st, batch, args, rows) if any(spec) else {}
        trees = [s.tree[: s.chunk] if sp and s.tree else None for s, sp in zip(batch, spec)]
        trees += [None] * (len(args[0]) - len(batch))  # the forks' chains
        logits = (self.runner.step(*args, rows=rows, trees=trees) if any(spec)
                  else self.runner.step(*args))  # fmt: skip
        starts = [0, *torch.tensor(rows).cumsum(0).tolist()]
        premap = 0.0
        if self.map_ahead:  # on a GPU the step is still running: map the next one's pages
            tp = time.perf_counter()
            for seq in batch:
                p = seq.req.params
                if seq.draft:  # its length changes once the drafts are verified
                    continue
                if len(seq.generated) + 1 < p.max_new_tokens:  # (a stop token frees it)
                    st.premapped_pages += self.kv.memory.reserve(seq.slot, 1)
            premap = time.perf_counter() - tp
        now = time.perf_counter()
        for i, (seq, decode) in enumerate(zip(batch, decodes)):
            if spec[i]:
                mine, branches = logits[starts[i] : starts[i + 1]], None
                if i in forks:  # a token tree verified in forks: their rows too
                    at = [starts[j] for j in forks[i][1]]
                    branches = (forks[i][0], [logits[a : a + r] for a, r in zip(at, forks[i][2])])
                self._verify(seq, mine, branches)
                continue
            row = logits[starts[i + 1] - 1]
            seq.cached += seq.chunk
            if not decode:
                self.kv.cache_prefix(seq.slot)  # its prompt's full pages, for later requests
            if seq.cached < len(seq.tokens):
                continue  # a prompt chunk: the rest comes in later steps, no token yet
            times = self.times[seq.req.req_id]
            times[1] = now if times[1] is None else times[1]
            kids = self._fork_siblings(seq, row)  # before the parent's token joins its context
            self._append(seq, self._sample(row, seq))
            if self.on_prefilled is not None and seq.status is Status.RUNNING:
                self.on_prefilled(seq, [k for k in kids if k.status is Status.RUNNING])
        keep = self.keep_free_pages
        if keep is not None and self.kv.pool.num_free_created > keep:
            st.released_pages += self.kv.pool.trim(keep)
        t2 = time.perf_counter()
        st.steps += 1
        st.map_s += t1 - t0
        st.premap_s += premap
        st.model_s += t2 - t1 - premap
        st.step_s.append(t2 - t0)
        st.max_running = max(st.max_running, len(sched.running))
        for name in ("preempt_swap", "preempt_recompute", "swap_bytes", "recompute_tokens",
                     "prefix_hit_tokens", "prefix_waits"):  # fmt: skip
            setattr(st, name, getattr(sched, name))

    def serve(self, requests: list[Request], arrivals_s: list[float]) -> dict:
        """Open loop: request ``i`` is added ``arrivals_s[i]`` seconds (wall clock) after the
        start, whether or not earlier ones finished; steps run while anything is queued and
        the engine sleeps until the next arrival when nothing is. Returns the outputs."""
        if len(arrivals_s) != len(requests) or sorted(arrivals_s) != list(arrivals_s):
            raise ValueError("arrivals_s must be one sorted time per request")
        t0 = time.perf_counter()
        i = 0
        while i < len(requests) or self.scheduler.has_work():
            now = time.perf_counter() - t0
            while i < len(requests) and arrivals_s[i] <= now:
                self.add_request(requests[i], t0 + arrivals_s[i])
                i += 1
            if not self.scheduler.has_work():
                time.sleep(max(arrivals_s[i] - now, 0))
                continue
            self.step()
        self.stats.elapsed_s += time.perf_counter() - t0
        return {rid: out for rid, out in self.outputs.items()}

    def latency_records(self) -> list[tuple[float, float, float, int]]:
        """(arrival, first token, finish, tokens per sequence) of every finished request."""
        return [(a, f, e, len(self.outputs[rid][0])) for rid, (a, f, e) in self.times.items()
                if e is not None]  # fmt: skip

    def run(self, requests: list[Request] = ()) -> dict[str, list[list[int]]]:
        """Add ``requests``, step until every queued request finished; returns the outputs."""
        for r in requests:
            self.add_request(r)
        t0 = time.perf_counter()
        while self.scheduler.has_work():
            self.step()
        if self.speculative is not None:
            self.speculative.forget(self.scheduler.running)  # a draft model's slots
        self.stats.elapsed_s += time.perf_counter() - t0
        return {rid: out for rid, out in self.outputs.items()}
