"""What the engine does to a logits row before it samples (a request's logit bias and
repetition penalties), and what it reports of the model's distribution (log-probabilities).

    model's row ─┬─ log_softmax ─▶ logprobs reported (the sampled token's, its rank, top-k)
                 └─ + logit_bias ─▶ repetition / frequency / presence penalties
                                  ─▶ temperature, top-k/p, min-p ─▶ sampled (or argmax)

Reported log-probabilities are the model's own, before the request's bias, penalties,
temperature and filters (vLLM's default, ``raw_logprobs``): what a log-likelihood evaluation
needs, and the same whatever the sampling settings. Penalties follow vLLM's and OpenAI's
definitions: frequency and presence count the tokens generated so far; repetition (as
transformers' and CTRL's) covers prompt and generated tokens, dividing positive logits and
multiplying negative ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmcache.engine.drafts import sample


@dataclass(frozen=True)
class TokenLogprob:
    """One position's report: ``token`` and its log-probability, its ``rank`` (1: the most
    likely; ties share the better rank) and the ``top`` alternatives, most likely first
    (``k`` of them as the request asked; empty for 0)."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """``rows`` fp32 ``[R, V]`` (row r: the model's logits before ``tokens[r]``) → one
    :class:`TokenLogprob` per row, with its ``k`` most likely alternatives. One
    ``log_softmax`` and one ``topk`` for all rows."""
    if len(tokens) != rows.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows for {len(tokens)} tokens")
    if not tokens:
        return []
    lp = torch.log_softmax(rows.float(), dim=-1)
    idx = torch.tensor(tokens, device=lp.device)[:, None]
    chosen = lp.gather(1, idx)  # [R, 1]
    ranks = ((lp > chosen).sum(1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    if k:
        vals, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, c, r, top) for t, c, r, top in zip(tokens, chosen, ranks, tops)]


def processed(row: torch.Tensor, params, prompt: tuple[int, ...], generated: list[int]):
    """``row`` fp32 ``[V]`` with ``params``' logit bias and penalties applied (a new tensor;
    ``row`` itself when the request sets none): what temperature and sampling then see."""
    if not params.processes_logits:
        return row
    out = row.float().clone()
    vocab = out.shape[0]
    for token, bias in params.logit_bias:
        if token < vocab:
            out[token] += bias
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt, *generated}), dtype=torch.long)
        seen = seen[seen < vocab]
        vals = out[seen]
        rp = params.repetition_penalty
        out[seen] = torch.where(vals > 0, vals / rp, vals * rp)
    if generated and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return out


def pick(seq, row: torch.Tensor, greedy: int | None = None) -> int:
    """Sequence ``seq``'s next token from its logits ``row`` fp32 ``[V]`` (``greedy``: the
    row's argmax, taken as is when the request changes no logits), its log-probability
    recorded on ``seq`` when the request asks."""
    p = seq.req.params
    if greedy is None or p.processes_logits:
        row_p = processed(row, p, seq.req.prompt, seq.generated)
        greedy = sample(row_p, p.temperature, p.top_k, seq.generator, p.top_p, p.min_p)
    if p.logprobs is not None:
        seq.logprobs += token_logprobs(row[None], [greedy], p.logprobs)
    return greedy


def record_prompt_logprobs(seq, rows: torch.Tensor) -> None:
    """The prompt tokens a prefill chunk's ``rows`` fp32 ``[chunk, V]`` predict, reported on
    ``seq`` (before its ``cached`` moves past the chunk).

        tokens:  p0  p1  p2 | p3  p4  p5 | p6 ...      chunk [cached, cached + chunk)
        rows:               | r3  r4  r5 |             row j predicts position cached+j+1
        reported: p4, p5 and p6 (p0 has no context: None)
    """
    prompt, out = seq.req.prompt, seq.prompt_logprobs
    if not out:
        out.append(None)
    lo, first = len(out), seq.cached + 1
    hi = min(len(prompt), seq.cached + seq.chunk + 1)
    if lo < first:  # a prefix hit skipped positions: admission must not allow it
        raise RuntimeError(f"prompt log-probabilities from {lo} missing (prefill at {first})")
    if lo < hi:
        sel = rows[lo - first : hi - first]
        out += token_logprobs(sel, list(prompt[lo:hi]), seq.req.params.prompt_logprobs)
