"""The operators' C shims (vmcache.kernels.aoti_shims) in a real AOTInductor package: the
package calls them (no proxy executor), gives the Python operators' outputs bit for bit on
every kind of step (the kernel's own and those the shim hands back to the operator), refuses
out-of-bounds indices without touching the store, and leaks no reference on the way back."""

from __future__ import annotations

import zipfile

import pytest
import torch
from torch import nn

from vmcache.kernels import aoti_shims, cpu_gemm, step_op
from vmcache.kernels.step_op import step_attention

pytestmark = pytest.mark.skipif(not aoti_shims.available()[0],
                                reason=f"no C shims here: {aoti_shims.available()[1]}")  # fmt: skip

HQ, HKV, D = 4, 2, 16
R = HKV * D
WIDTH = HQ * D + 2 * R  # the fused q, k, v GEMM's columns
ROWS = 64  # K (and V) rows in the store


class Layer(nn.Module):
    """A fused QKV GEMM (its K and V strided slices of the output, as in a compiled layer),
    the step's attention, and an output GEMM whose input comes in transposed."""

    def forward(self, x, qkv, bias, out_w, xt_w, store, layout, write, read, lens, xt):
        h = torch.ops.vmcache.packed_linear(x, qkv, WIDTH, bias)
        q = h[:, : HQ * D].reshape(-1, HQ, D)
        k, v = h[:, HQ * D : HQ * D + R], h[:, HQ * D + R :]
        o = step_attention(q, k, v, store, layout, write, read, lens, 0.125)
        extra = torch.ops.vmcache.packed_linear(xt, xt_w, 16, None)  # xt: [N, 8] strided
        return torch.ops.vmcache.packed_linear(o.reshape(-1, HQ * D), out_w, HQ * D, None), extra


def inputs(q_lens, kv_extra, seed=0):
    """A step of len(q_lens) sequences: sequence b brings q_lens[b] tokens after kv_extra[b]
    stored ones (its rows a random permutation's slice of the store)."""
    g = torch.Generator().manual_seed(seed)
    n, b = sum(q_lens), len(q_lens)
    kv = [q + e for q, e in zip(q_lens, kv_extra)]
    span = max(kv) + 3
    perm = torch.randperm(ROWS, generator=g)
    read = torch.stack([perm[(7 * i) % ROWS :].repeat(2)[:span] for i in range(b)])
    write = torch.cat([read[i, e : e + q] for i, (q, e) in enumerate(zip(q_lens, kv_extra))])
    store = torch.randn(2 * ROWS * R + 5, generator=g)
    layout = torch.tensor([ROWS, R, 3, 3 + ROWS * R])
    lens = torch.tensor([list(q_lens), kv])
    x = torch.randn(n, 24, generator=g)
    xt = torch.randn(8, n, generator=g).t()
    return [x, store, layout, write, read, lens, xt]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    from torch.export import Dim

    g = torch.Generator().manual_seed(9)
    weights = (cpu_gemm.pack(torch.randn(WIDTH, 24, generator=g)), torch.randn(WIDTH, generator=g),
               cpu_gemm.pack(torch.randn(HQ * D, HQ * D, generator=g)),
               cpu_gemm.pack(torch.randn(16, 8, generator=g)))  # fmt: skip
    # (write distinct rows: a duplicate's order would be the only difference)
    x, store, layout, write, read, lens, xt = inputs((1, 3, 1, 2), (4, 5, 9, 2))
    example = (x, *weights, store, layout, write, read, lens, xt)
    n, b, s = Dim("tokens", min=2), Dim("seqs", min=1), Dim("span", min=1)
    dims = ({0: n}, None, None, None, None, {0: Dim("storage", min=1)}, None, {0: n}, {0: b, 1: s},
            {1: b}, {0: n})  # fmt: skip
    ep = torch.export.export(Layer(), example, dynamic_shapes=dims, strict=False)
    path = str(tmp_path_factory.mktemp("shims") / "layer.pt2")
    settings = aoti_shims.inductor_settings()
    torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=settings)
    return path, weights


def run_both(package, step):
    """→ (the Python operators' outputs, the package's, their stores, whether the package
    handed the step to the Python operator)."""
    path, weights = package
    model = torch._inductor.aoti_load_package(path)
    x, store, layout, write, read, lens, xt = step
    mine = store.clone()
    step_op._LAST_PLAN[0] = None  # (set by the operator's Python kernel when it plans a step)
    with torch.inference_mode():
        got = model(x, *weights, mine, layout, write, read, lens, xt)
        handed = step_op._LAST_PLAN[0] is not None
        want = Layer()(x, *weights, store, layout, write, read, lens, xt)
    return want, got, store, mine, handed


def test_the_package_calls_the_shims_not_the_proxy_executor(package):
    with zipfile.ZipFile(package[0]) as z:
        cpp = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    if not cpp:  # (the steps' tests below still tell the shims' path from the operator's)
        pytest.skip("this torch's package keeps no wrapper source")
    assert "aoti_torch_cpu_packed_linear(" in cpp and "aoti_torch_cpu_step_attention(" in cpp
    assert "proxy_executor_call_function" not in cpp


@pytest.mark.parametrize(
    "q_lens, kv_extra, handed",
    [((1, 1, 1), (5, 0, 30), False),  # decodes (the shim's kernel)
     ((1, 16, 9, 1), (3, 0, 20, 7), False),  # short prefills beside decodes (a query a token)
     ((1, 17, 1), (3, 2, 8), True),  # a long prefill beside decodes: handed to the operator
     ((20, 33), (0, 4), True)],  # long prefills only: the operator's gather and SDPA
)  # fmt: skip
def test_outputs_and_store_equal_the_python_operators_bit_for_bit(package, q_lens, kv_extra,
                                                                 handed):  # fmt: skip
    want, got, store, mine, was = run_both(package, inputs(q_lens, kv_extra, seed=len(q_lens)))
    assert was == handed
    for w, o in zip(want, got):
        assert torch.equal(w, o)
    assert torch.equal(store, mine)


@pytest.mark.parametrize("where", ["read", "write"])
def test_an_index_past_the_rows_is_refused_and_the_store_untouched(package, where):
    step = inputs((1, 1), (4, 6))
    bad = step[3 if where == "write" else 4].clone()
    bad.view(-1)[1] = ROWS  # one past the last row
    step[3 if where == "write" else 4] = bad
    path, weights = package
    model = torch._inductor.aoti_load_package(path)
    x, store, layout, write, read, lens, xt = step
    before = store.clone()
    with torch.inference_mode(), pytest.raises(RuntimeError):
        model(x, *weights, store, layout, write, read, lens, xt)
    assert torch.equal(store, before)


def test_handing_a_step_to_the_operator_leaks_no_reference(package):
    step = inputs((1, 17, 1), (3, 2, 8))
    lens = step[5]
    count = torch._C._storage_Use_Count(lens.untyped_storage()._cdata)
    for _ in range(3):
        run_both(package, step)
    assert torch._C._storage_Use_Count(lens.untyped_storage()._cdata) == count
