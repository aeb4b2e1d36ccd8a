"""The CPU's compiled step built from one decoder layer: the layer exported with its weights as
*inputs* and compiled once into an AOTInductor package, every layer running that package on its
own weights. A model's decoder layers are one module class with the same weights' names and
shapes, so compiling the whole model's graph compiles the same code once a layer: SmolLM2's 30
layers took 90 s of a first start on an AMD EPYC's 2 cores (2026-12-06), nearly all of it
inductor tracing and generating code 30 times, not gcc. One layer compiles in a few seconds,
and the package holds no weights (any weights of the same architecture run it).

    build   the model's forward run up to its first layer (a hook stops it there): what the
            model hands a layer (hidden states, rotary cos / sin, ...) → the layer's inputs;
            the layer run once on fake tensors: its linear layers that read one input (q, k
            and v; gate and up) → one GEMM each on their weights stacked and packed
            (:mod:`vmcache.kernels.cpu_gemm`), as the whole-graph build merges them
            (:mod:`vmcache.engine.packed_linears`); a copy of the layer with those linears as
            slices of the merged GEMMs, its other weights inputs, exported and compiled

    step(ids, pos, keep, store, layout, write, read, lens)
            the model's own forward (embedding, rotary, final norm), its ``model.layers`` and
            ``lm_head`` swapped for the call (then restored) by
              layer i   package(hidden, <what the model hands a layer>, store, layout[i:i+1],
                                write, read, lens, *layer i's packed weights)
              lm_head   the packed GEMM on its weight, at the rows the step keeps

Where the layers differ, the model hands its layers an attention mask, or the CPU GEMM does not
build here, :func:`unsupported` says why and the whole model's graph is compiled instead. On
SmolLM2 (AMD EPYC, 2 cores, 2026-12-06) a first build took 16 s instead of 80-90 s and a load 3
instead of 5 s, and a step took what the whole graph's did (medians of 40 alternating steps: a
lone decode 22.4 / 22.3 ms, 4 decodes 25.7 / 26.7, 16 decodes 58.4 / 59.9) once the packed
weights lay in a file-backed mapping (:mod:`vmcache.engine.mapped`; from torch's allocations
the lone decode took 25.5 ms). The swap of the model's modules lasts one step, on the thread
that runs it: a model serves one step at a time (an engine's).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from vmcache.engine.mapped import file_backed
from vmcache.engine.packaged import compile_package
from vmcache.engine.packed_linears import stack
from vmcache.kernels import cpu_gemm

EXAMPLE_TOKENS = 4  # the export's token count (each kwarg tensor with it in dim 1 gets dim N)
# inductor's settings for the layer: no freezing (its weights are inputs) and kernels that read
# the thread count when they run
SETTINGS = {"cpp.dynamic_threads": True}
_PLAIN = (type(None), bool, int, float, str)


class _Stop(Exception):
    """Raised by the first layer's hook: the model's forward has handed it its inputs."""

    def __init__(self, args, kwargs) -> None:
        super().__init__("stopped at the first layer")
        self.args, self.kwargs = args, kwargs


def unsupported(model) -> str | None:
    """Why the step cannot be built from one layer here (None: it can)."""
    if not cpu_gemm.available()[0]:
        return f"no CPU GEMM kernel ({cpu_gemm.available()[1]})"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return "no model.layers"

    def shape(layer):  # fmt: skip
        return ([(n, p.shape, p.dtype) for n, p in layer.named_parameters()],
                [n for n, _ in layer.named_buffers()])  # fmt: skip

    first = shape(layers[0])
    if first[1]:
        return "decoder layers with buffers"
    if any(type(m) is not type(layers[0]) or shape(m) != first for m in layers):
        return "decoder layers of different classes or weights"
    if any(dtype != torch.float32 for _, _, dtype in first[0]):
        return "weights other than float32"
    if getattr(getattr(layers[0], "self_attn", None), "layer_idx", None) != 0:
        return "a first layer whose layer_idx is not 0"
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or head.weight.dtype != torch.float32:
        return "an lm_head that is not a float32 linear layer"
    return None


def capture(model, step_kwarg: str, step: dict, ids, pos) -> tuple[list, dict]:
    """What the model's forward hands its first layer for ``ids`` at ``pos`` (its
    ``step_kwarg`` dict left out) → (positional args, kwargs); ``ValueError`` where the layer
    would get anything but tensors, tuples of tensors and plain values, or a mask."""

    def stop(module, args, kwargs):  # fmt: skip
        raise _Stop(args, kwargs)

    hook = model.model.layers[0].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        model(input_ids=ids, position_ids=pos, use_cache=False, **{step_kwarg: step})
    except _Stop as e:
        args, kwargs = list(e.args), {k: v for k, v in e.kwargs.items() if k != step_kwarg}
    else:
        raise ValueError("the model's forward never called its first layer")
    finally:
        hook.remove()
    if kwargs.get("attention_mask") is not None:
        raise ValueError("the model hands its layers an attention mask")
    for v in [*args, *kwargs.values()]:
        ok = isinstance(v, (torch.Tensor, *_PLAIN)) or (
            isinstance(v, tuple) and all(isinstance(t, torch.Tensor) for t in v))  # fmt: skip
        if not ok:
            raise ValueError(f"the model hands its layers a {type(v).__name__}")
    if len(args) != 1 or not isinstance(args[0], torch.Tensor):
        raise ValueError("the model hands its layers more than the hidden states positionally")
    return args, kwargs


def _flat(kwargs: dict) -> tuple[list[torch.Tensor], list]:
    """kwargs' tensors in order, and how to put them back (name, count or None: plain)."""
    tensors, how = [], []
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            how.append((k, 0))
        elif isinstance(v, tuple):
            tensors += list(v)
            how.append((k, len(v)))
        else:
            how.append((k, None))
    return tensors, how


def _unflat(how: list, plain: dict, tensors) -> dict:
    it, out = iter(tensors), {}
    for k, n in how:
        if n is None:
            out[k] = plain[k]
        else:
            out[k] = next(it) if n == 0 else tuple(next(it) for _ in range(n))
    return out


def groups_of(layer, hidden, kwargs: dict, step_kwarg: str, step: dict) -> list[list[str]]:
    """The layer's float32 ``nn.Linear`` modules grouped by the input they read (call order),
    found by running it once on fake tensors (nothing is written anywhere)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    linears = {n: m for n, m in layer.named_modules() if type(m) is nn.Linear}
    seen: dict[int, list[str]] = {}
    keep = []  # the inputs, alive while their ids key `seen`

    def record(name, module, args):
        keep.append(args[0])
        seen.setdefault(id(args[0]), []).append(name)

    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: record(n, mod, a))
             for n, m in linears.items()]  # fmt: skip
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = {k: mode.from_tensor(v) for k, v in step.items()}
            fk = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else
                      tuple(mode.from_tensor(t) for t in v) if isinstance(v, tuple) else v)
                  for k, v in kwargs.items()}  # fmt: skip
            layer(mode.from_tensor(hidden), **fk, **{step_kwarg: fake})
    finally:
        for h in hooks:
            h.remove()
    found = list(seen.values())
    if sorted(n for g in found for n in g) != sorted(linears):
        raise ValueError("a linear layer of the decoder layer did not run")
    return found


def weights_of(layer, groups: list[list[str]]) -> list[torch.Tensor]:
    """Layer's inputs after the step's: per group its packed stacked weight (and stacked bias
    where any has one), then every other parameter by name."""
    out, grouped = [], set()
    for names in groups:
        mods = [layer.get_submodule(n) for n in names]
        packed, bias = stack([m.weight for m in mods], [m.bias for m in mods])
        out += [packed] if bias is None else [packed, bias]
        grouped |= {f"{n}.{p}" for n in names for p in ("weight", "bias")}
    out += [p.detach() for n, p in layer.named_parameters() if n not in grouped]
    return out


class _Group:
    """One merged GEMM while a layer is traced: its output for the input it last saw."""

    def __init__(self, n: int, bias: bool) -> None:
        self.n, self.has_bias = n, bias
        self.packed = self.bias = self.x = self.out = None

    def __call__(self, x):
        if self.x is not x:
            self.x = x
            self.out = torch.ops.vmcache.packed_linear(x, self.packed, self.n, self.bias)
        return self.out


class _Slice(nn.Module):
    """A linear layer as its columns of a merged GEMM."""

    def __init__(self, group: _Group, start: int, stop: int) -> None:
        super().__init__()
        self.group, self.start, self.stop = group, start, stop

    def forward(self, x):
        out = self.group(x)
        if (self.start, self.stop) == (0, self.group.n):
            return out
        return out[..., self.start : self.stop]


class OneLayer(nn.Module):
    """A copy of a decoder layer for export: ``forward(hidden, *kwarg tensors, store, layout,
    write, read, lens, *weights)`` (weights as :func:`weights_of` lists them)."""

    def __init__(self, layer, groups, how, plain, step_kwarg) -> None:
        super().__init__()
        self.layer = copy.deepcopy(layer)
        self.how, self.plain, self.step_kwarg = how, plain, step_kwarg
        self.merged = []
        for names in groups:
            mods = [layer.get_submodule(n) for n in names]
            g = _Group(sum(m.out_features for m in mods), any(m.bias is not None for m in mods))
            start = 0
            for name, m in zip(names, mods):
                owner, _, leaf = name.rpartition(".")
                setattr(self.layer.get_submodule(owner) if owner else self.layer, leaf,
                        _Slice(g, start, start + m.out_features))  # fmt: skip
                start += m.out_features
            self.merged.append(g)
        self.names = [n for n, _ in self.layer.named_parameters()]
        self.n_kw = sum(1 if n == 0 else n or 0 for _, n in how)

    def forward(self, hidden, *inputs):
        kw, rest = inputs[: self.n_kw], list(inputs[self.n_kw :])
        store, layout, write, read, lens = rest[:5]
        it = iter(rest[5:])
        for g in self.merged:
            g.packed, g.bias, g.x = next(it), next(it) if g.has_bias else None, None
        params = {n: next(it) for n in self.names}
        step = {"store": store, "layout": layout, "write": write, "read": read, "lens": lens}
        kwargs = _unflat(self.how, self.plain, kw)
        out = torch.func.functional_call(self.layer, params, (hidden,),
                                         {**kwargs, self.step_kwarg: step})  # fmt: skip
        return out[0] if isinstance(out, tuple) else out


def dims_of(example: tuple, n_kw: int) -> tuple:
    """export dims: N for dim 1 of the hidden states and of every kwarg tensor that has the
    example's token count there; storage, tokens, sequences and span for the step's inputs."""
    from torch.export import Dim

    n, b, s = Dim("tokens", min=2), Dim("seqs", min=1), Dim("span", min=1)
    kw = [{1: n} if t.dim() > 1 and t.shape[1] == EXAMPLE_TOKENS else None
          for t in example[1 : 1 + n_kw]]  # fmt: skip
    step = [{0: Dim("storage", min=1)}, None, {0: n}, {0: b, 1: s}, {1: b}]
    return ({1: n}, (*kw, *step, *[None] * (len(example) - 6 - n_kw)))  # (hidden, *inputs)


class LayeredStep:
    """The step (module docstring) on a loaded one-layer package: ``__call__(ids, pos, keep,
    store, layout, write, read, lens)`` → logits ``[B, vocab]`` fp32."""

    def __init__(self, model, package, groups, how, step_kwarg, attention, directory) -> None:
        self.model, self.run = model, package.loader.boxed_run
        self.how, self.step_kwarg, self.attention = how, step_kwarg, attention
        self._memo = None  # (the step's dict, its inputs every layer shares): one step's
        self.groups = groups  # the linear layers each GEMM runs (names in a layer)
        weights = [weights_of(layer, groups) for layer in model.model.layers]
        head = model.lm_head
        # the weights streamed every step (the packed GEMMs' panels) in one file-backed mapping
        flat = [w for ws in weights for w in ws] + [cpu_gemm.pack(head.weight.detach())]
        big = [i for i, w in enumerate(flat) if w.dim() == 3]
        for i, w in zip(big, file_backed([flat[i] for i in big], directory)):
            flat[i] = w
        it = iter(flat)
        self.weights = [[next(it) for _ in ws] for ws in weights]
        self.head = _Head(next(it), head.out_features,
                          None if head.bias is None else head.bias.detach())  # fmt: skip
        self.calls = nn.ModuleList(_LayerCall(self, i) for i in range(len(self.weights)))

    def layer(self, i: int, hidden, kwargs: dict) -> torch.Tensor:
        step = kwargs[self.step_kwarg]
        memo = self._memo
        if memo is None or memo[0] is not step:  # the step's first layer: its inputs once
            if kwargs.get("attention_mask") is not None:
                raise ValueError("the compiled layers take no attention mask")
            kw, _ = _flat({k: kwargs[k] for k, _ in self.how})
            layouts = step["layout"].split(1)
            tail = [step["write"], step["read"], step["lens"]]
            memo = self._memo = (step, [t.contiguous() for t in kw], layouts, [step["store"]],
                                 tail)  # fmt: skip
        _, kw, layouts, store, tail = memo
        return self.run([hidden, *kw, *store, layouts[i], *tail, *self.weights[i]])[0]

    def __call__(self, ids, pos, keep, store, layout, write, read, lens) -> torch.Tensor:
        step = {"store": store, "layout": layout, "write": write, "read": read, "lens": lens}
        m = self.model
        layers, head = m.model.layers, m.lm_head
        try:  # (the user's modules back whatever happens)
            m.model.layers, m.lm_head = self.calls, self.head
            with self.attention():
                out = m(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep,
                        **{self.step_kwarg: step})  # fmt: skip
        finally:
            m.model.layers, m.lm_head = layers, head
            self._memo = None
        return out.logits[0].float()


class _LayerCall(nn.Module):
    def __init__(self, step: LayeredStep, index: int) -> None:
        super().__init__()
        self.index = index
        self.__dict__["step"] = step  # (not a submodule)

    def forward(self, hidden_states, **kwargs):
        return self.step.layer(self.index, hidden_states, kwargs)


class _Head(nn.Module):
    def __init__(self, packed, n, bias) -> None:
        super().__init__()
        self.packed, self.n, self.bias = packed, n, bias

    def forward(self, x):  # (through the dispatcher: a profile counts it a linear layer)
        return torch.ops.vmcache.packed_linear(x, self.packed, self.n, self.bias)


class Plan:
    """What building and running the step from one layer needs, found on the model: the kwargs
    its forward hands a layer (``how`` to rebuild them from tensors, their ``plain`` values),
    the linear groups, and the export's example inputs before the weights."""

    def __init__(self, model, step_kwarg: str, example: tuple) -> None:
        ids, pos, _, store, layout, write, read, lens = example
        step = {"store": store, "layout": layout[0:1], "write": write, "read": read,
                "lens": lens}  # fmt: skip
        with torch.inference_mode():
            args, kwargs = capture(model, step_kwarg, step, ids, pos)
            layer = model.model.layers[0]
            self.groups = groups_of(layer, args[0], kwargs, step_kwarg, step)
        tensors, self.how = _flat(kwargs)
        self.plain = {k: kwargs[k] for k, n in self.how if n is None}
        self.step_kwarg = step_kwarg
        # the export's example inputs up to the weights (packed by build: a load needs none)
        self.inputs = (args[0], *tensors, store, layout[0:1], write, read, lens)
        self.n_kw = len(tensors)

    def key(self) -> dict:
        """What of the plan shapes the package's code (for its key)."""
        plain = repr(sorted(self.plain.items()))
        return {"groups": self.groups, "kwargs": self.how, "plain": plain}

    def build(self, model, settings: dict, path: str) -> None:
        """Export the first layer's copy and compile it into an AOTInductor package."""
        layer = model.model.layers[0]
        one = OneLayer(layer, self.groups, self.how, self.plain, self.step_kwarg)
        example = (*self.inputs, *weights_of(layer, self.groups))
        ep = torch.export.export(one, example, dynamic_shapes=dims_of(example, self.n_kw),
                                 strict=False)  # fmt: skip
        compile_package(ep, settings, path)

    def step(self, model, package, attention, directory) -> LayeredStep:
        """The step on the loaded ``package``; its packed weights mapped from a file written
        (and unlinked) in the private ``directory``."""
        return LayeredStep(model, package, self.groups, self.how, self.step_kwarg, attention,
                           directory)  # fmt: skip
