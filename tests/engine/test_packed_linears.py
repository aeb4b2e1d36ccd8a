"""The pass that puts the CPU step's linear layers on packed weights
(vmcache.engine.packed_linears): layers sharing an input become one call, outputs and every
size the dims allow unchanged, the float32 layers only, the source module untouched."""

import pytest
import torch
from torch.export import Dim

from vmcache.engine.packed_linears import PREFIX, pack_linears
from vmcache.kernels import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available()[0],
                                reason=f"no kernel: {cpu_gemm.available()[1]}")  # fmt: skip
PACKED = torch.ops.vmcache.packed_linear.default


class Block(torch.nn.Module):
    """q, k, v on one input (v with a bias), a layer on their sum, one in float64."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(24, 40, bias=False), torch.nn.Linear(24, 8, bias=False)
        self.v = torch.nn.Linear(24, 8)
        self.o = torch.nn.Linear(56, 24, bias=False)
        self.wide = torch.nn.Linear(24, 3, bias=False).double()

    def forward(self, x):
        h = torch.cat([self.q(x), torch.relu(self.k(x)), self.v(x)], -1)
        out = self.o(h)
        return out, self.wide(out.double())


def _calls(ep, target):
    return [n for n in ep.graph.nodes if n.op == "call_function" and n.target is target]


def test_layers_on_one_input_become_one_call_with_the_same_outputs():
    torch.manual_seed(0)
    block = Block().eval()
    before = {k: (v.data_ptr(), v.clone()) for k, v in block.state_dict().items()}
    example, dims = (torch.randn(3, 24),), ({0: Dim("rows", min=1)},)
    ep = torch.export.export(block, example, dynamic_shapes=dims, strict=False)
    packed = pack_linears(ep, example, dims)
    linears = torch.ops.aten.linear.default
    assert len(_calls(ep, linears)) == 5  # the source program keeps its own
    assert len(_calls(packed, PACKED)) == 2  # [q; k; v] and o
    assert len(_calls(packed, linears)) == 1  # the float64 layer stays
    (qkv,) = [n for n in _calls(packed, PACKED) if n.args[2] == 56]
    assert qkv.args[3] is not None  # v's bias, zeros beside q's and k's
    kept = set(packed.state_dict) | set(packed.constants)
    assert {"q.weight", "k.weight", "v.weight", "o.weight"}.isdisjoint(kept)
    assert "wide.weight" in kept and any(k.startswith(PREFIX) for k in kept)
    for rows in (1, 5, 70):  # sizes the export did not trace at
        x = torch.randn(rows, 24)
        want, got = block(x), packed.module()(x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1])
    for k, v in block.state_dict().items():  # the user's module: same tensors, same values
        assert v.data_ptr() == before[k][0] and torch.equal(v, before[k][1])


def test_a_chain_of_layers_each_on_the_last_ones_output():
    torch.manual_seed(1)
    chain = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)]).eval()
    example, dims = (torch.randn(2, 16),), ({0: Dim("rows", min=1)},)
    ep = torch.export.export(chain, example, dynamic_shapes=dims, strict=False)
    packed = pack_linears(ep, example, dims)
    assert len(_calls(packed, PACKED)) == 4
    x = torch.randn(9, 16)
    torch.testing.assert_close(packed.module()(x), chain(x), rtol=1e-5, atol=1e-5)


def test_a_program_without_float32_layers_comes_back_as_it_is():
    m = torch.nn.Linear(4, 4).double()
    ep = torch.export.export(m, (torch.randn(2, 4, dtype=torch.float64),), strict=False)
    assert pack_linears(ep, (torch.randn(2, 4, dtype=torch.float64),), None) is ep
