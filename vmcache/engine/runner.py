"""Runs one engine step of a transformers decoder-only model (Llama, Qwen2, Mistral, Gemma
2 / 3, ...) over a vmcache cache through the model's own forward: every scheduled sequence's
new tokens packed into one row, RoPE positions per token, K/V written into the cache,
attention straight from it (``vmcache.kernels``), logits of the rows asked for only
(``logits_to_keep``).

    packed row:  | seq a: 37 prompt tokens | seq b: 1 | seq c: 1 | seq d: 12 prompt tokens |
    positions:   | 0 .. 36                  | 80      | 5        | 0 .. 11                  |
    q_lens:      [37, 1, 1, 12]   starts: [0, 80, 5, 0]   (K/V go to [start, start+q_len))

The model's forward runs unchanged (embedding, rotary per layer type, layers, norm, head,
Gemma's final soft-capping: nothing of it is copied here), with the attention
implementation :data:`~vmcache.hf.attention.STEP_ATTN_NAME` for the length of each step
only (vmcache's attention, and a mask function that builds none): the configs the model
reads are switched when a step starts and restored when it ends (an exception included), so
the user's model is left as it was (its ``generate`` and ``generate_batch`` keep working
between engine steps). The step's batch (:meth:`~vmcache.sequences.coordinator.SequenceCache.batch`:
checked, copied on write, indexed) is built once, then every layer writes its K/V with one
call and reads them with one.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from vmcache import kernels
from vmcache.hf import cache_keyword, stand_ins
from vmcache.hf.attention import STEP_ATTN_NAME
from vmcache.kernels.common import TreeMasks
from vmcache.sequences.spec import KVSpec


class _StepLayer(CacheLayerMixin):
    is_compileable = False

    def __init__(self, owner: StepCache, idx: int) -> None:
        super().__init__()
        self.owner, self.idx, self.is_initialized = owner, idx, True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner._write(self.idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.owner.kv.config.max_seq_len


class StepCache(Cache):
    """A transformers ``Cache`` for one packed step: ``update`` writes each sequence's slice
    of ``[1, N_KV, N, d_h]`` K/V into the engine's cache and returns zero-stride stand-ins
    tagged for :func:`vmcache.hf.vmcache_attention`, which calls :meth:`attend`."""

    def __init__(self, kv) -> None:
        self.kv, self.spec = kv, kv.spec
        self.masks: list | None = None  # token trees' masks (None: every sequence causal)
        # the step's StepBatch (vmcache.sequences.batch): its slots, starts and q_lens
        self.batch = None
        self.layers_written: set[int] = set()  # this step's layers whose K/V were written
        self.plans: dict = {}  # the step's kernel plans (vmcache.kernels.plan), new each step
        super().__init__(layers=[_StepLayer(self, i) for i in range(kv.spec.num_layers)])

    def begin(self, slots: list[int], starts: list[int], q_lens: list[int], masks=None) -> None:
        """The step's sequences: checked, copied on write and indexed once here
        (``kv.batch``), then every layer writes and reads them in one call each."""
        self.masks = masks
        self.batch = self.kv.batch(slots, q_lens)
        if list(self.batch.starts) != list(starts):
            raise ValueError(f"the step's tokens must be each sequence's last: starts "
                             f"{starts}, lengths {list(self.batch.kv_lens)}")  # fmt: skip
        self.layers_written = set()
        self.plans = {}

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        k = k[0].transpose(0, 1).to(self.spec.dtype)  # [N, N_KV, d_h]
        v = v[0].transpose(0, 1).to(self.spec.dtype)
        self.batch.write(layer, k, v)
        self.layers_written.add(layer)
        keys, values = stand_ins(self.spec, k.device, 1, k.shape[0])
        keys._vmcache = values._vmcache = (self, layer)
        return keys, values

    def attend(self, layer: int, query: torch.Tensor, scale: float | None,
               softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        """query ``[1, N_Q, N, d_h]`` (packed) → ``[1, N, N_Q, d_h]``."""
        q = query[0].transpose(0, 1)
        b = self.batch
        out = kernels.attend(self.kv, layer, q, b.seq_ids, b.q_lens, scale=scale,
                             softcap=softcap, masks=self.masks, batch=b,
                             plans=self.plans)  # fmt: skip
        return out[None]

    def real_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Never called: a packed step has no padding mask (its sequences' lengths differ, so
        there is no one ``[b, N_KV, n, d_h]`` history to hand SDPA); raises if it were."""
        raise ValueError(f"layer {layer}: the engine's packed step is read by attend() "
                         "only; a masked call means the model built a padding mask")  # fmt: skip


class ModelRunner:
    """``step(slots, starts, tokens)`` → next-token logits ``[len(slots), vocab]`` (fp32)."""

    def __init__(self, model, kv) -> None:
        inner = getattr(model, "model", None)
        takes = inspect.signature(model.forward).parameters
        if inner is None or not hasattr(inner, "layers") or "logits_to_keep" not in takes:
            raise TypeError(
                "ModelRunner needs a transformers decoder-only model (model.model.layers, a "
                f"forward taking logits_to_keep); got {type(model).__name__}"
            )
        # the kernels take each layer's window from the cache's spec: it must be the model's
        windows = KVSpec.from_hf_config(model.config).layer_windows
        if kv.spec.layer_windows != windows:
            raise ValueError(f"the cache's layer windows {kv.spec.layer_windows} are not the "
                             f"model's {windows}: build it with KVSpec.from_hf_config")  # fmt: skip
        # the configs the model reads its attention implementation from (the model's, its
        # text config's and any other object a module holds), switched per step by _attention
        configs = {id(model.config): model.config}
        for m in model.modules():
            cfg_m = getattr(m, "config", None)
            if cfg_m is not None and hasattr(cfg_m, "_attn_implementation"):
                configs.setdefault(id(cfg_m), cfg_m)
        self._configs = list(configs.values())
        self.model, self.inner, self.kv = model, inner, kv
        self.device = next(model.parameters()).device
        self.cache = StepCache(kv)
        # transformers 5.17–5.23 take past_key_values=, 5.24+ cache=; a decoder layer given
        # the other name swallows it into **kwargs and writes nothing
        self.cache_arg = cache_keyword(inner.layers[0])

    @contextlib.contextmanager
    def _attention(self, name: str = STEP_ATTN_NAME):
        """Attention implementation ``name`` on the model's configs for one step, then what
        they held before."""
        before = [c._attn_implementation for c in self._configs]
        try:
            for c in self._configs:
                c._attn_implementation = name
            yield
        finally:
            for c, b in zip(self._configs, before):
                c._attn_implementation = b

    @torch.inference_mode()
    def step(self, slots: list[int], starts: list[int], tokens: list[list[int]],
             rows: list[int] | None = None, trees: list | None = None) -> torch.Tensor:  # fmt: skip
        """Sequence ``slots[i]`` already holds (and has been grown to cover) positions
        ``[starts[i], starts[i] + len(tokens[i]))``; their K/V are written here. Returns the
        logits of each sequence's last ``rows[i]`` positions (default 1; speculative
        verification asks for all), ``[sum(rows), vocab]`` in sequence order.

        ``trees[i]`` (None: a causal run): ``tokens[i]`` is a token tree in topological
        order, ``trees[i][j]`` the index of token j's parent (−1 for the first, whose parent
        is the history); token j is embedded at position ``starts[i] + depth(j)`` and attends
        to the history and its own ancestors (:func:`~vmcache.kernels.common.tree_mask`),
        while its K/V are stored at ``starts[i] + j``."""
        q_lens = [len(t) for t in tokens]
        masks = [None] * len(q_lens) if trees is None else [_ancestors(t) for t in trees]
        # a token's position is its depth in its tree (its row of ancestors, less itself)
        offsets = [torch.arange(n) if m is None else m.sum(1) - 1 for m, n in zip(masks, q_lens)]
        on_device = [None if m is None else m.to(self.device) for m in masks]
        trees_here = any(m is not None for m in masks)
        # one object for every layer: the Triton prefill packs its ancestor words once a step
        self.cache.begin(slots, starts, q_lens, TreeMasks(on_device) if trees_here else None)
        ids = torch.tensor([t for ts in tokens for t in ts], device=self.device)[None]
        pos = torch.cat([a + o for a, o in zip(starts, offsets)])
        pos = pos.to(self.device)[None]
        with self._attention():
            return self._forward(ids, pos, q_lens, rows)

    def _forward(self, ids, pos, q_lens, rows) -> torch.Tensor:
        ends = torch.tensor(q_lens).cumsum(0)
        if rows is None:
            last = ends - 1
        else:
            last = torch.cat([torch.arange(int(e) - r, int(e)) for e, r in zip(ends, rows)])
        keep = last.to(self.device)
        with torch.profiler.record_function("vmcache: model"):  # (a profiler's scope)
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True,
                             logits_to_keep=keep, **{self.cache_arg: self.cache})  # fmt: skip
        missing = len(self.inner.layers) - len(self.cache.layers_written)
        if missing:
            raise RuntimeError(
                f"{missing} of {len(self.inner.layers)} decoder layers wrote no K/V to the "
                f"cache (passed as {self.cache_arg}=): this transformers version or model "
                "does not call cache.update; refusing to return logits computed without it"
            )
        return out.logits[0].float()


def _ancestors(parents: list[int] | None) -> torch.Tensor | None:
    """bool ``[n, n]``: row j true at j and its ancestors (parents before children);
    a row's count less one is the token's depth."""
    if parents is None:
        return None
    n = len(parents)
    anc = torch.zeros((n, n), dtype=torch.bool)
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"tree token {j}'s parent {p} must come before it (or be -1)")
        if p >= 0:
            anc[j] = anc[p]
        anc[j, j] = True
    return anc
