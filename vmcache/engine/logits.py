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
