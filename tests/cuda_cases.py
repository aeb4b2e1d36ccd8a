"""The GPU tests' caches: K/V of 2 layers, 8 KV heads and d 128 written on the device at
lengths on, before and after 2 MiB page edges, kept on the host as the oracle."""

import torch

from vmcache import VMKVCache
from vmcache.paged_fallback import PagedKVCache

# 2 layers, 8 KV heads, d 128: a 2 MiB page holds 1,024 tokens (layer_major) or 512
# (token_major, both layers in a token row); lengths land on, before and after page edges
LENS = [1, 63, 64, 65, 511, 512, 513, 1023, 1024, 1025, 4097]


def fill_on_gpu(kind, spec, lens=LENS):
    if kind == "paged":
        cache = PagedKVCache(spec, num_blocks=4000, block_size=16, device="cuda",
                             max_seq_len=4200, max_seqs=len(lens))  # fmt: skip
    else:
        layout = "token_major" if kind == "vm_token_major" else "layer_major"
        cache = VMKVCache(spec, len(lens), 4200, device="cuda", layout=layout)
    written, seqs = {}, []
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in lens:
        s = cache.new_sequence()
        cache.grow(s, n)
        for layer in range(spec.num_layers):
            k, v = (torch.randn(n, 8, 128, device="cuda", generator=g).to(spec.dtype)
                    for _ in range(2))  # fmt: skip
            cache.write(layer, s, 0, k, v)
            written[s, layer] = (k.cpu(), v.cpu())  # the oracle: what was written
        seqs.append(s)
    return cache, seqs, written
