"""A small Llama-style model (RoPE, GQA, RMSNorm, SwiGLU) written straight against VMKVCache
and vmcache.kernels: no transformers. Runs on the CPU in a few seconds.

    python examples/tiny_llama.py

Per step: grow every sequence by its new tokens (pages are mapped here), then per layer write
K/V into the cache and attend with ``kernels.prefill`` (several tokens) or ``kernels.decode``.
Two prompts decode side by side; a fork gives a third sequence sharing the first prompt's pages.
"""

from __future__ import annotations

import torch
from torch import nn

from vmcache import KVSpec, VMKVCache, kernels


class Block(nn.Module):
    def __init__(self, dim: int, q_heads: int, kv_heads: int) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = q_heads, kv_heads, dim // q_heads
        self.qkv = nn.Linear(dim, (q_heads + 2 * kv_heads) * self.d, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x, cos, sin, cache, layer, seqs, starts, q_lens):
        """x: [N, dim] packed tokens of ``seqs``; token i of seq j is at position starts[j]+i."""
        q, k, v = self.qkv(self.n1(x)).split([self.hq * self.d, self.hkv * self.d,
                                              self.hkv * self.d], -1)  # fmt: skip
        q, k = (
            rope(q.view(-1, self.hq, self.d), cos, sin),
            rope(k.view(-1, self.hkv, self.d), cos, sin),
        )
        v, i = v.view(-1, self.hkv, self.d), 0
        for s, start, n in zip(seqs, starts, q_lens):
            cache.write(layer, s, start, k[i : i + n], v[i : i + n])
            i += n
        if all(n == 1 for n in q_lens):
            a = kernels.decode(cache, layer, q, seqs)
        else:
            a = kernels.prefill(cache, layer, q, seqs, q_lens)
        x = x + self.out(a.reshape(x.shape))
        gate, up = self.up(self.n2(x)).chunk(2, -1)
        return x + self.down(nn.functional.silu(gate) * up)


def rope(x, cos, sin):  # x: [N, H, d]; cos/sin: [N, d/2]
    x1, x2 = x.float().chunk(2, -1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1).to(x.dtype)


class TinyLlama(nn.Module):
    def __init__(self, vocab=256, dim=128, layers=2, q_heads=4, kv_heads=2) -> None:
        super().__init__()
        self.spec = KVSpec(layers, kv_heads, dim // q_heads, torch.float32, q_heads)
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, q_heads, kv_heads) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        d = dim // q_heads
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2) / d))

    @torch.no_grad()
    def step(self, cache: VMKVCache, seqs: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """Append ``tokens[j]`` to sequence ``seqs[j]``; next-token logits ``[len(seqs), V]``."""
        starts = [cache.seq_len(s) for s in seqs]
        for s, t in zip(seqs, tokens):
            cache.grow(s, len(t))  # plan: pages for this step are mapped before any layer runs
        q_lens = [len(t) for t in tokens]
        pos = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, q_lens)]).float()
        ang = pos[:, None] * self.inv_freq[None]
        cos, sin = ang.cos(), ang.sin()
        x = self.emb(torch.tensor([t for ts in tokens for t in ts]))
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, layer, seqs, starts, q_lens)
        last = torch.tensor(q_lens).cumsum(0) - 1
        return self.head(self.norm(x[last]))


def main():
    torch.manual_seed(0)
    model = TinyLlama().eval()
    cache = VMKVCache(model.spec, max_seqs=4, max_seq_len=512, page_size=4096)
    a, b = cache.new_sequence(), cache.new_sequence()
    prompts = [list(range(1, 40)), list(range(100, 110))]
    logits = model.step(cache, [a, b], prompts)  # one packed prefill of 39 + 10 tokens
    c = cache.fork(a)[0]  # shares a's 39 tokens of K/V, copy-on-write
    seqs, out = [a, b, c], {a: [], b: [], c: []}
    nxt = logits.argmax(-1).tolist() + [int(logits[0].topk(2).indices[1])]  # c takes a's 2nd best
    for _ in range(24):
        for s, t in zip(seqs, nxt):
            out[s].append(t)
        nxt = model.step(cache, seqs, [[t] for t in nxt]).argmax(-1).tolist()
    for s in seqs:
        print(f"sequence {s}: {cache.seq_len(s)} tokens, generated {out[s][:12]}...")
    st = cache.stats()
    print(f"{st.physical_pages} physical pages for {st.mapped_bytes // st.page_bytes} mapped "
          f"({st.shared_pages} shared), internal waste {st.internal_waste:.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
