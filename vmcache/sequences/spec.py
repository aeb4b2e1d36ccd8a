"""KVSpec: the model shape a KV cache stores, and the byte arithmetic derived from it.

    M_KV(L) = 2 · N_L · N_KV · d_h · L · b        (K and V, every layer, L tokens)

(plus 2 · N_L · round_up(4 · N_KV, 16) · L bytes of per-token scales with
``kv_granularity="token"``).

Every figure in the docs, tests and benchmarks comes from these properties. b is the bytes of
the *storage* dtype: ``kv_dtype`` (FP8 or INT8: b = 1, see :mod:`vmcache.sequences.quant`)
when set, else the compute ``dtype``.

Per-layer attention type: ``layer_windows[l]`` is None for a full-attention layer, or W for a
sliding-window layer whose token at position p attends to keys in (p − W, p] (transformers'
convention for ``sliding_window``). Such a layer needs at most W tokens of K/V:

    min M_KV(L) = 2 · N_KV · d_h · b · Σ_l min(L, W_l)        (W_l = ∞ for full layers)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from vmcache.sequences.quant import GRANULARITIES, Q_MAX, SCALE_ALIGN

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    num_q_heads: int | None = None  # known for real models; None = same as num_kv_heads
    layer_windows: tuple[int | None, ...] | None = None  # per layer: None full, W sliding
    kv_dtype: torch.dtype | None = None  # K/V storage: None = dtype; float8_e4m3fn/e5m2, int8
    kv_scales: tuple[float, ...] | None = None  # [layer][K, V][KV head] flattened; None = 1.0
    kv_granularity: str = "head"  # "head": the static kv_scales; "token": per token, in its row

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"KVSpec.{name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"KVSpec.{name} must be positive, got {value}")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"KVSpec.dtype must be a floating torch dtype "
                f"(float16, bfloat16, float32, float64), got {self.dtype!r}"
            )
        if self.layer_windows is not None:
            w = self.layer_windows
            if not isinstance(w, tuple) or len(w) != self.num_layers:
                raise ValueError(f"KVSpec.layer_windows must be a tuple of num_layers "
                                 f"({self.num_layers}) entries, got {w!r}")  # fmt: skip
            for x in w:
                if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 1):
                    raise ValueError(f"KVSpec.layer_windows entries must be None (full "
                                     f"attention) or a window >= 1, got {x!r}")  # fmt: skip
        self._check_storage()
        if self.num_q_heads is not None:
            q = self.num_q_heads
            if isinstance(q, bool) or not isinstance(q, int) or q <= 0:
                raise ValueError(f"KVSpec.num_q_heads must be a positive int, got {q!r}")
            if q % self.num_kv_heads:
                raise ValueError(
                    f"KVSpec.num_q_heads ({q}) must be a multiple of num_kv_heads "
                    f"({self.num_kv_heads})"
                )

    def _check_storage(self) -> None:
        kv = self.kv_dtype
        if kv is not None and kv != self.dtype and kv not in Q_MAX:
            raise ValueError(f"KVSpec.kv_dtype must be None, the dtype, or one of "
                             f"{sorted(map(str, Q_MAX))}, got {kv!r}")  # fmt: skip
        if self.kv_granularity not in GRANULARITIES:
            raise ValueError(f"KVSpec.kv_granularity must be one of {GRANULARITIES}, got "
                             f"{self.kv_granularity!r}")  # fmt: skip
        if self.kv_granularity == "token":
            if not self.quantized:
                raise ValueError("KVSpec.kv_granularity='token' needs a quantized kv_dtype")
            if self.kv_scales is not None:
                raise ValueError("per-token scales are computed as tokens are written: "
                                 "kv_scales must be None with kv_granularity='token'")  # fmt: skip
            return
        if self.kv_scales is None:
            if kv == torch.int8:
                raise ValueError("int8 K/V needs kv_scales (INT8 is uniform: calibrate them, "
                                 "vmcache.hf.calibrate_kv_scales)")  # fmt: skip
            return
        if not self.quantized:
            raise ValueError("KVSpec.kv_scales needs a quantized kv_dtype (FP8 or INT8)")
        want = 2 * self.num_layers * self.num_kv_heads
        sc = self.kv_scales
        if not isinstance(sc, tuple) or len(sc) != want:
            raise ValueError(f"KVSpec.kv_scales must be a tuple of 2 · num_layers · "
                             f"num_kv_heads = {want} floats")  # fmt: skip
        for x in sc:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < float("inf"):
                raise ValueError(f"KVSpec.kv_scales entries must be finite and > 0, got {x!r}")

    # --- derived arithmetic -------------------------------------------------------------
    @cached_property  # read by every layer's write and view: computed once
    def storage_dtype(self) -> torch.dtype:
        """What the pages hold: ``kv_dtype`` when set, else the compute ``dtype``."""
        return self.kv_dtype or self.dtype

    @cached_property
    def quantized(self) -> bool:
        """K/V stored as FP8 or INT8 with scales (written quantized, read dequantized)."""
        return self.storage_dtype in Q_MAX

    @cached_property
    def dtype_bytes(self) -> int:
        """b: bytes of one stored element (the storage dtype's)."""
        return self.storage_dtype.itemsize

    def scales(self) -> torch.Tensor:
        """fp32 ``[N_L, 2, N_KV]`` dequantization scales (1.0 where none are given)."""
        shape = (self.num_layers, 2, self.num_kv_heads)
        if self.kv_scales is None:
            return torch.ones(shape)
        return torch.tensor(self.kv_scales, dtype=torch.float32).view(shape)

    @property
    def q_heads(self) -> int:
        return self.num_q_heads or self.num_kv_heads

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.q_heads // self.num_kv_heads

    @property
    def scale_bytes_per_token_per_layer(self) -> int:
        """Bytes of per-token scales one token's K (or V) row carries in one layer:
        4 · N_KV rounded up to 16 with ``kv_granularity="token"``, else 0."""
        if self.kv_granularity != "token":
            return 0
        return -(-4 * self.num_kv_heads // SCALE_ALIGN) * SCALE_ALIGN

    @cached_property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of K (or of V) of one token in one layer: N_KV · d_h · b, plus its scales
        (:attr:`scale_bytes_per_token_per_layer`)."""
        data = self.num_kv_heads * self.head_dim * self.dtype_bytes
        return data + self.scale_bytes_per_token_per_layer

    @cached_property
    def row_elems(self) -> int:
        """Storage-dtype elements of one stored row (one token, layer, K or V; see
        :mod:`vmcache.sequences.quant`): N_KV · d_h, plus the scale bytes when per token."""
        return self.bytes_per_token_per_layer // self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers: 2 · N_L · N_KV · d_h · b."""
        return 2 * self.num_layers * self.bytes_per_token_per_layer

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers (empty: every layer attends to everything)."""
        return tuple(i for i, w in enumerate(self.layer_windows or ()) if w is not None)

    @property
    def attention_groups(self) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
        """Layers by attention type, in order of their first layer: ``((window, layers),
        ...)``, window None for full attention (one group when no layer slides)."""
        windows = self.layer_windows or (None,) * self.num_layers
        groups: dict[int | None, list[int]] = {}
        for i, w in enumerate(windows):
            groups.setdefault(w, []).append(i)
        return tuple((w, tuple(layers)) for w, layers in groups.items())

    def window_kv_bytes(self, num_tokens: int) -> int:
        """The K/V a sequence of ``num_tokens`` needs when every sliding layer keeps only its
        window: 2 · N_KV · d_h · b · Σ_l min(L, W_l) (the bound a windowed cache aims at)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        windows = self.layer_windows or (None,) * self.num_layers
        held = sum(num_tokens if w is None else min(num_tokens, w) for w in windows)
        return 2 * held * self.bytes_per_token_per_layer

    def kv_bytes(self, num_tokens: int) -> int:
        """M_KV(L): bytes of K and V for ``num_tokens`` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return num_tokens * self.bytes_per_token

    def block_bytes(self, block_size: int, per_layer: bool = True) -> int:
        """Bytes of one paged block of ``block_size`` tokens.

        ``per_layer=True``: one layer's K and V blocks (65,536 B for B=16, 8 heads, d_h 128,
        bf16). ``per_layer=False``: K and V of every layer that one block id stands for.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if per_layer:
            return 2 * block_size * self.bytes_per_token_per_layer
        return block_size * self.bytes_per_token

    # --- constructors -------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, dtype: torch.dtype = torch.bfloat16,
               kv_dtype: torch.dtype | None = None,
               kv_granularity: str = "head") -> KVSpec:  # fmt: skip
        try:
            layers, kv_heads, head_dim, q_heads = _PRESETS[name.lower()]
        except (KeyError, AttributeError):
            raise ValueError(
                f"unknown KVSpec preset {name!r}; expected one of {sorted(_PRESETS)}"
            ) from None
        return cls(layers, kv_heads, head_dim, dtype, q_heads, kv_dtype=kv_dtype,
                   kv_granularity=kv_granularity)  # fmt: skip

    @classmethod
    def from_hf_config(cls, config: Any, dtype: torch.dtype | None = None,
                       kv_dtype: torch.dtype | None = None, kv_scales=None,
                       kv_granularity: str = "head") -> KVSpec:  # fmt: skip
        """Read a transformers config (Llama, Mistral, Qwen2, ... and their text sub-configs);
        ``kv_dtype`` / ``kv_scales`` / ``kv_granularity``: quantized K/V storage (see the
        fields)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        try:
            layers = int(config.num_hidden_layers)
            q_heads = int(config.num_attention_heads)
            hidden = int(config.hidden_size)
        except (AttributeError, TypeError) as exc:
            raise ValueError(
                "config must define num_hidden_layers, num_attention_heads and hidden_size "
                f"(got {type(config).__name__}: {exc})"
            ) from None
        kv_heads = getattr(config, "num_key_value_heads", None) or q_heads  # missing = MHA
        head_dim = getattr(config, "head_dim", None) or hidden // q_heads
        if dtype is None:
            # 5.x names it ``dtype`` (reading ``torch_dtype`` there only warns); 4.x ``torch_dtype``
            name = "dtype" if "dtype" in vars(config) else "torch_dtype"
            dtype = getattr(config, name, None)
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype, None)
            if dtype is None:
                dtype = torch.float32
        return cls(layers, int(kv_heads), int(head_dim), dtype, q_heads,
                   _layer_windows(config, layers), kv_dtype, kv_scales,
                   kv_granularity)  # fmt: skip


def check_kv(spec: KVSpec, device: torch.device, k: Any, v: Any) -> int:
    """Validate K and V for a write (each ``[T, N_KV, d_h]``, ``spec.dtype``, on ``device``'s
    type); returns T."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or tuple(x.shape[1:]) != (spec.num_kv_heads, spec.head_dim):
            raise ValueError(f"{name} must have shape [T, {spec.num_kv_heads}, {spec.head_dim}],"
                             f" got {list(x.shape)}")  # fmt: skip
        if x.dtype != spec.dtype:
            raise TypeError(f"{name} must have dtype {spec.dtype}, got {x.dtype}")
        if x.device.type != device.type:
            raise ValueError(f"{name} must be on {device}, got {x.device}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v hold different token counts: {k.shape[0]} vs {v.shape[0]}")
    return k.shape[0]


def _layer_windows(config: Any, layers: int) -> tuple[int | None, ...] | None:
    """Per-layer windows from a transformers config: ``layer_types`` ("full_attention" /
    "sliding_attention", with ``sliding_window``: Gemma 2/3, Qwen2, ...), else a
    ``sliding_window`` that applies to every layer unless ``use_sliding_window`` is False
    (Mistral). None when every layer attends to everything."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        types = list(types)
        if len(types) != layers or not set(types) <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"unsupported layer_types {types!r}: expected {layers} entries of "
                             "'full_attention' or 'sliding_attention'")  # fmt: skip
        if "sliding_attention" not in types:
            return None
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"layer_types has sliding layers but sliding_window is {window!r}")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if isinstance(window, int) and window > 0 and getattr(config, "use_sliding_window", True):
        return (window,) * layers
    return None


# name: (num_layers, num_kv_heads, head_dim, num_q_heads)
_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "llama-3-8b": (32, 8, 128, 32),
    "llama-3-70b": (80, 8, 128, 64),
    "llama-2-70b": (80, 64, 128, 64),
    "llama-3.2-1b": (16, 8, 64, 32),
}
