"""The CPU step's linear layers on :mod:`vmcache.kernels.cpu_gemm`: a pass over the exported
step that replaces its float32 ``aten.linear`` calls with ``vmcache::packed_linear`` on weights
packed once, before inductor compiles the graph.

Linear layers that read the same input become one call on their weights stacked (q, k and v;
gate and up), as vLLM's merged layers and inductor's concat-linear pass do, and each layer's
output is that call's slice:

    x ─► linear(x, W_q) ─► q           x ─► packed_linear(x, pack([W_q; W_k; W_v]), n_q+n_k+n_v)
    x ─► linear(x, W_k) ─► k     ⇒          ├─ [..., 0 : n_q]          ─► q
    x ─► linear(x, W_v) ─► v                ├─ [..., n_q : n_q+n_k]    ─► k
                                            └─ [..., n_q+n_k : ]       ─► v

The pass works on ``ep.module()`` (a graph module of the export's own, holding the weights by
reference; the user's model is not touched), registers the packed weights on it, drops the
weights no call reads any more, and exports it again with the same dims; inductor then freezes
the packed weights into the package as constants.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from vmcache.kernels import cpu_gemm

LINEAR = torch.ops.aten.linear.default
PREFIX = "vmcache_packed_"  # the packed weights' attribute names on the graph module


def _attr(gm: GraphModule, node: Node | None) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads (None: not a get_attr, or not a tensor)."""
    if node is None or node.op != "get_attr":
        return None
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def _bias(node: Node):
    """A linear call's bias argument (a node or None), positional or by keyword."""
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _linears(gm: GraphModule) -> dict[Node, list[Node]]:
    """The float32 linear calls on constant weights, grouped by their input (graph order)."""
    groups: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not LINEAR:
            continue
        x, w, b = node.args[0], node.args[1], _bias(node)
        weight, val = _attr(gm, w), x.meta.get("val") if isinstance(x, Node) else None
        if weight is None or weight.dim() != 2 or weight.dtype != torch.float32:
            continue
        if val is None or val.dtype != torch.float32 or (b is not None and _attr(gm, b) is None):
            continue
        groups.setdefault(x, []).append(node)
    return groups


def stack(weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
    """Linear layers on one input as one GEMM: their weights stacked and packed
    (:func:`~vmcache.kernels.cpu_gemm.pack`), and their biases stacked (zeros for a layer
    without one; None where none has one) → (packed, bias)."""
    packed = cpu_gemm.pack(torch.cat([w.detach() for w in weights]))
    if all(b is None for b in biases):
        return packed, None
    return packed, torch.cat([torch.zeros(w.shape[0]) if b is None else b.detach().float()
                              for w, b in zip(weights, biases)])  # fmt: skip


def _replace(gm: GraphModule, nodes: list[Node], index: int) -> None:
    """One ``packed_linear`` call for ``nodes`` (all on one input), their outputs slices."""
    x = nodes[0].args[0]  # (now: where an earlier group's layer fed it, that layer's slice)
    weights = [_attr(gm, n.args[1]) for n in nodes]
    biases = [_attr(gm, _bias(n)) for n in nodes]
    sizes = [w.shape[0] for w in weights]
    name = f"{PREFIX}{index}"
    with torch.no_grad():
        panels, stacked = stack(weights, biases)
        gm.register_buffer(name, panels)
        bias = None
        if stacked is not None:
            gm.register_buffer(f"{name}_bias", stacked)
            bias = f"{name}_bias"
    graph = gm.graph
    with graph.inserting_before(nodes[0]):
        packed = graph.get_attr(name)
        b_node = graph.get_attr(bias) if bias is not None else None
        out = graph.call_function(torch.ops.vmcache.packed_linear.default,
                                  (x, packed, sum(sizes), b_node))  # fmt: skip
        start = 0
        for node, size in zip(nodes, sizes):
            piece = graph.call_function(torch.ops.aten.slice.Tensor,
                                        (out, -1, start, start + size))  # fmt: skip
            node.replace_all_uses_with(piece)
            start += size
    for node in nodes:
        graph.erase_node(node)


def _drop_unread(gm: GraphModule) -> None:
    """Remove the get_attr nodes nothing reads, and the weights no node reads any more."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    read = {n.target for n in graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name not in read:
            owner, _, leaf = name.rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            delattr(module, leaf)


def pack_linears(ep: torch.export.ExportedProgram, example: tuple,
                 dims) -> torch.export.ExportedProgram:  # fmt: skip
    """``ep`` with its float32 linear layers on packed weights (module docstring), exported
    again at ``example`` with ``dims``; ``ep`` itself unchanged. Where the kernel cannot be
    built here, ``ep`` as it is."""
    if not cpu_gemm.available()[0]:
        return ep
    gm = ep.module()
    groups = _linears(gm)
    if not groups:
        return ep
    for i, nodes in enumerate(groups.values()):
        _replace(gm, nodes, i)
    _drop_unread(gm)
    gm.graph.lint()
    gm.recompile()
    return torch.export.export(gm, example, dynamic_shapes=dims, strict=False)
