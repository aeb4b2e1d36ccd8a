"""Token trees (vmcache/engine/tree.py): the tree mask (one sequence) and a fork per branch
keep greedy outputs; a tree step's logits equal each chain's run alone; the accepted path is
compacted into place (K/V and token ids, only what moved); sampled trees and sampled draft
models keep the target distribution (statistical tests that a wrong verifier fails)."""

import pytest
import torch
from draft_cases import draft_cache, draft_llama, repeating, run
from engine_cases import make

from vmcache.engine import DraftModel, NgramDrafter, Request, SamplingParams
from vmcache.engine.drafts import target_probs, verify, verify_tree
from vmcache.engine.runner import ModelRunner
from vmcache.engine.tree import flatten
from vmcache.sequences.invariants import check_invariants


def branching(seed=0, n=3, new=40, temperature=0.0):
    """Prompts where one phrase is followed by different continuations: a tree has branches."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        head = torch.randint(0, 128, (4,), generator=g).tolist()
        tails = [torch.randint(0, 128, (4,), generator=g).tolist() for _ in range(3)]
        prompt = [t for tail in tails for t in head + tail] + head
        params = SamplingParams(max_new_tokens=new, temperature=temperature, seed=i)
        reqs.append(Request(f"b{i}", tuple(prompt), params))
    return reqs


class Oracle(NgramDrafter):
    """A drafter that knows the greedy answers: its tree is a wrong chain first (what the
    sequence itself verifies) and the right one second (a branch), so the branch always
    wins; a test double for the drafter's one contract, ``tree(tokens, limit)``."""

    def __init__(self, answers, **kw) -> None:
        super().__init__(**kw)
        object.__setattr__(self, "answers", answers)

    def tree(self, tokens, limit):
        for prompt, answer in self.answers:
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                right = list(answer[done : done + min(limit, self.k)])
                return [[(t + 1) % 128 for t in right], right] if right else []
        return []


@pytest.mark.parametrize("mode", ["mask", "fork"])
@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_a_token_tree_keeps_greedy_outputs(model, kind, mode):
    """Up to three chains per sequence, verified with a tree mask in the sequence's own range
    or in forks sharing every page of the history; outputs equal the engine's without
    speculation, a tree accepts no less than a chain here, and nothing leaks. With the
    right chain second every time, the branch wins every verification: the mask way copies
    exactly the accepted tokens into place, the fork way copies pages, never more steps."""
    reqs = branching() + repeating(n=2)
    plain, base = run(model, make(kind, 64), reqs)
    out, st = run(model, make(kind, 64), reqs,
                  speculative=NgramDrafter(k=4, branches=3, tree_mode=mode))  # fmt: skip
    assert out == plain
    assert st.speculation.tree_steps > 0 and st.speculation.tree_branches > 0
    chain, st_chain = run(model, make(kind, 64), reqs, speculative=NgramDrafter(k=4))
    assert chain == plain
    assert st.speculation.accepted >= st_chain.speculation.accepted
    answers = [(r.prompt, out[r.req_id][0]) for r in reqs]
    out, st = run(model, make(kind, 64), reqs,
                  speculative=Oracle(answers, k=4, branches=2, tree_mode=mode))  # fmt: skip
    assert out == plain
    assert st.speculation.tree_wins == st.speculation.tree_steps > 0
    bpt = make(kind, 8).spec.bytes_per_token
    if mode == "mask":  # every verification a tree, half of it right, just that copied
        assert st.speculation.tree_steps == st.speculation.steps
        assert st.speculation.accepted == st.speculation.proposed // 2
        assert st.speculation.tree_copied_bytes == st.speculation.accepted * bpt
        assert st.steps < base.steps / 3
    else:  # a branch needs a free slot for its fork: without one the main chain goes alone
        assert 0 < st.speculation.tree_copied_bytes and st.steps < base.steps / 2
    d = NgramDrafter(k=2, branches=3)
    assert d.tree([1, 2, 5, 1, 2, 6, 1, 2, 7, 1, 2], 5) == [[7, 1], [6, 1], [5, 1]]


def test_flatten_orders_a_tree_topologically():
    assert flatten([[7, 1], [6], [5, 1, 2]]) == ([7, 1, 6, 5, 1, 2], [-1, 0, 1, 0, 0, 4, 5])
    with pytest.raises(ValueError, match="tree_mode"):
        NgramDrafter(branches=2, tree_mode="both")


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_a_tree_step_gives_each_chain_the_logits_it_gets_alone(model, kind):
    """Two chains as one tree (positions by depth, the tree mask) against each chain fed on
    its own after the same history: the same logits at every node, and a causal neighbour
    in the same step is unaffected."""
    hist = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    a, b = [5, 9, 11], [17, 2]
    toks, parents = flatten([a, b])

    def prefill(cache, runner, n_step):  # the history less its last token, then room
        s = cache.new_sequence()
        cache.grow(s, len(hist) - 1)
        runner.step([s], [0], [hist[:-1]])
        cache.grow(s, n_step)  # for the next step's tokens (the queries are the last ones)
        return s

    cache = make(kind, 64)
    runner = ModelRunner(model, cache)
    s, other = prefill(cache, runner, 1 + len(toks)), prefill(cache, runner, 1)
    n = len(hist) - 1
    got = runner.step([s, other], [n, n], [[hist[-1], *toks], [hist[-1]]],
                      rows=[1 + len(toks), 1], trees=[parents, None])  # fmt: skip
    for chain, nodes in ((a, [0, 1, 2, 3]), (b, [0, 4, 5])):
        ref_cache = make(kind, 64)
        r = ModelRunner(model, ref_cache)
        t = prefill(ref_cache, r, 1 + len(chain))
        want = r.step([t], [n], [[hist[-1], *chain]], rows=[1 + len(chain)])
        torch.testing.assert_close(got[nodes], want, atol=2e-5, rtol=1e-4)
    alone = ModelRunner(model, c := make(kind, 64))
    u = prefill(c, alone, 1)
    torch.testing.assert_close(got[-1:], alone.step([u], [n], [[hist[-1]]]), atol=2e-5,
                               rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_compact_moves_only_the_path_off_the_first_chain(kind):
    cache = make(kind, 64)
    s = cache.new_sequence()
    cache.grow(s, 10, token_ids=list(range(100, 110)))
    spec = cache.spec
    vals = torch.arange(10, dtype=spec.dtype)[:, None, None].expand(
        10, spec.num_kv_heads, spec.head_dim)  # fmt: skip
    for layer in range(spec.num_layers):
        cache.write(layer, s, 0, vals + layer, -vals)
    (kid,) = cache.fork(s)  # every page shared: the compaction must copy, not write through
    assert cache.beams.compact(s, 4, [4, 5]) == 0 and cache.seq_len(s) == 6  # in place
    cache.grow(s, 4, token_ids=list(range(106, 110)))
    for layer in range(spec.num_layers):
        cache.write(layer, s, 6, vals[6:] + layer, -vals[6:])
    copied = cache.beams.compact(s, 4, [4, 7, 9])
    assert copied == 2 * spec.bytes_per_token and cache.seq_len(s) == 7
    for layer in range(spec.num_layers):
        k, v = cache.kv(layer, s)
        assert k[:, 0, 0].tolist() == [x + layer for x in (0, 1, 2, 3, 4, 7, 9)]
        assert v[:, 0, 0].tolist() == [-x for x in (0, 1, 2, 3, 4, 7, 9)]
        assert cache.kv(layer, kid)[0][:, 0, 0].tolist() == [x + layer for x in range(10)]
    assert cache._seqs.tokens(s) == [100, 101, 102, 103, 104, 107, 109]  # ids moved with K/V
    for bad in ([3], [5, 5], [4, 99]):
        with pytest.raises(ValueError):
            cache.beams.compact(s, 4, bad)
    with pytest.raises(TypeError):
        cache.beams.compact(s, 4, [4.0])
    assert cache.seq_len(s) == 7
    check_invariants(cache)


def _chi2(counts, p):
    keep = p > 0
    expected = p[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum()) + float(counts[~keep].sum())


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -0.5])


def _tree_counts(walk, trials=20000):
    """The first token a tree with children 3 and 0 (3 → 1 below it) emits, at temperature 1."""
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS.roll(2), LOGITS])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(trials):
        path, token = walk(rows, [-1, 3, 1, 0], [-1, 0, 1, 0], 1.0, 0, g)
        counts[[-1, 3, 1, 0][path[0]] if path else token] += 1
    return counts, target_probs(LOGITS, 1.0, 0)


def test_a_sampled_tree_keeps_the_target_distribution():
    counts, p = _tree_counts(verify_tree)
    assert _chi2(counts, p) < 20.5  # chi-square, 5 degrees of freedom: p ≈ 0.001

    def each_child_alone(rows, tokens, parents, t, k, g):  # no residual between siblings
        p = target_probs(rows[0], t, k)
        for c in (1, 3):
            if float(torch.rand((), generator=g)) < float(p[tokens[c]]):
                return [c], 0
        return [], int(torch.multinomial(p, 1, generator=g))

    counts, p = _tree_counts(each_child_alone, trials=4000)
    assert _chi2(counts, p) > 100  # the test can fail


def _draft_model_counts(verifier, trials=20000):
    """A draft sampled from q (not a point mass) verified against p: (how often each token
    came first, how often the draft was accepted)."""
    q = target_probs(LOGITS.flip(0), 1.0, 0)
    rows = torch.stack([LOGITS, LOGITS])
    g = torch.Generator().manual_seed(1)
    counts, accepted_total = torch.zeros(6), 0
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=g))
        accepted, token = verifier(rows, [d], 1.0, 0, g, q[None])
        counts[d if accepted else token] += 1
        accepted_total += accepted
    return counts, target_probs(LOGITS, 1.0, 0), accepted_total / trials


def test_a_sampling_draft_model_keeps_the_target_distribution():
    """min(1, p/q) acceptance with the residual max(0, p − q): the target distribution, and
    more drafts accepted than verifying the same draft as a point mass (also unbiased:
    accept with p(d), else resample without d), which is what knowing q buys."""
    counts, p, rate = _draft_model_counts(verify)
    assert _chi2(counts, p) < 20.5
    _, _, point_rate = _draft_model_counts(lambda r, d, t, k, g, q: verify(r, d, t, k, g))
    expected = float(torch.minimum(p, target_probs(LOGITS.flip(0), 1.0, 0)).sum())
    assert abs(rate - expected) < 0.02 and rate > point_rate + 0.05

    def wrong_residual(rows, drafts, t, k, g, q):  # p/q acceptance, then p, not p − q
        accepted, token = verify(rows, drafts, t, k, g, q)
        return (accepted, token) if accepted else (0, verify(rows[:1], [], t, k, g)[1])

    counts, p, _ = _draft_model_counts(wrong_residual, trials=4000)
    assert _chi2(counts, p) > 100  # the test can fail


@pytest.mark.parametrize("mode", ["mask", "fork"])
def test_sampled_requests_run_trees_and_draft_models(model, mode):
    """Sampled requests through a tree and through a sampling draft model: they run to
    their lengths, reproducibly (same seeds, same tokens), and free everything."""
    reqs = branching(temperature=1.0) + [
        Request(f"s{i}", r.prompt, SamplingParams(max_new_tokens=30, temperature=0.8, seed=i))
        for i, r in enumerate(repeating(n=2))
    ]  # fmt: skip
    drafter = NgramDrafter(k=4, branches=3, tree_mode=mode)
    out, st = run(model, make("vm", 64), reqs, speculative=drafter)
    again, _ = run(model, make("vm", 64), reqs, speculative=drafter)
    assert out == again and st.speculation.tree_steps > 0
    assert all(len(o[0]) == r.params.max_new_tokens for r, o in zip(reqs, out.values()))
    dm = draft_llama()
    dmodel = DraftModel(dm, draft_cache(dm), k=3)
    out, st = run(model, make("paged", 48), reqs, speculative=dmodel)
    assert st.speculation.proposed > 0 and not dmodel.kv.sequences
    assert all(len(o[0]) == r.params.max_new_tokens for r, o in zip(reqs, out.values()))
