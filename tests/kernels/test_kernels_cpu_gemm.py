"""The CPU linear kernel (vmcache.kernels.cpu_gemm) against float64 ``x · Wᵀ + b`` over awkward
sizes (one row, rows across its 8- and 6-row blocks, its whole-K calls from 32 rows and its
64-row tasks, columns not a multiple of a panel, K past a 128 chunk or under one), its tall
blocks (6 rows by half a panel) wherever the machine's vectors are, bit for bit equal to the
default path, through its operator, and its refusals."""

import pytest
import torch

from vmcache.kernels import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available()[0],
                                reason=f"no kernel: {cpu_gemm.available()[1]}")  # fmt: skip


def _reference(x, w, b):
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


# every block tall (6 rows by 16 columns, from 1 row on): without AVX-512 the kernel takes
# them from 6 rows a task on; with it never, so they are built here to be checked everywhere
_TALL = cpu_gemm._KERNEL.variant("-DTALL=1")


def _tall_linear(x, packed, n, bias):
    out = torch.empty(x.shape[0], n)
    _TALL.fn(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
             out.data_ptr(), x.shape[0], x.shape[1], n, torch.get_num_threads())  # fmt: skip
    return out


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 32, 37, 63, 64, 65, 100, 130])
@pytest.mark.parametrize("n,k", [(1, 1), (31, 7), (32, 128), (33, 129), (100, 300), (96, 576)])
def test_matches_float64_reference(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    packed = cpu_gemm.pack(w)
    assert packed.shape == (-(-n // cpu_gemm.NB), k, cpu_gemm.NB)
    tol = 1e-5 * k**0.5
    for bias in (None, b):
        got = cpu_gemm.packed_linear(x, packed, n, bias)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), _reference(x, w, bias), rtol=1e-5, atol=tol)
        tall = _tall_linear(x, packed, n, bias)
        torch.testing.assert_close(tall.double(), _reference(x, w, bias), rtol=1e-5, atol=tol)
        # each sum runs over k in order whichever block and chunk holds it: where a call
        # turns tall or takes K whole changes no bit (so no token of a model)
        assert torch.equal(tall, got)


def test_leading_dims_threads_and_the_operator():
    x, w = torch.randn(2, 5, 40), torch.randn(70, 40)
    packed = cpu_gemm.pack(w)
    want = _reference(x.reshape(-1, 40), w, None).view(2, 5, 70)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            got = torch.ops.vmcache.packed_linear(x, packed, 70, None)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(threads)
    assert cpu_gemm.packed_linear(torch.empty(0, 40), packed, 70).shape == (0, 70)


def test_refusals():
    w = torch.randn(40, 16)
    packed = cpu_gemm.pack(w)
    x = torch.randn(3, 16)
    with pytest.raises(TypeError):
        cpu_gemm.pack(w.double())
    with pytest.raises(ValueError):
        cpu_gemm.pack(torch.empty(4, 0))
    with pytest.raises(TypeError):
        cpu_gemm.packed_linear(x.double(), packed, 40)
    with pytest.raises(ValueError):  # K differs
        cpu_gemm.packed_linear(torch.randn(3, 17), packed, 40)
    for n in (0, 32, 65):  # not a width these two panels hold
        with pytest.raises(ValueError):
            cpu_gemm.packed_linear(x, packed, n)
    with pytest.raises(ValueError):
        cpu_gemm.packed_linear(x, packed, 40, torch.randn(39))
    with pytest.raises(ValueError):
        cpu_gemm.packed_linear(x, packed.transpose(0, 1), 40)
    with pytest.raises(ValueError):  # a view of the panels, not them
        cpu_gemm.packed_linear(x, packed.transpose(1, 2).contiguous().transpose(1, 2), 40)
    with pytest.raises(ValueError):
        cpu_gemm.packed_linear(torch.tensor(1.0), packed, 40)
    strided = torch.randn(16, 3).t()  # [3, 16], not contiguous: taken as it is
    torch.testing.assert_close(cpu_gemm.packed_linear(strided, packed, 40), strided @ w.T,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
