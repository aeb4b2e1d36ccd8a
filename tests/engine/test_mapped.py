"""Weights copied into one file-backed mapping (vmcache.engine.mapped): the same values at
aligned starts, copies (not the originals), and no file left behind."""

import pytest
import torch

from vmcache.engine.mapped import ALIGN_BYTES, file_backed


def test_copies_at_aligned_starts_and_no_file_left(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, 7, generator=g), torch.randn(1, generator=g),
               torch.randn(33, 17, generator=g)]  # fmt: skip
    got = file_backed(tensors, tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked before it returned
    for t, m in zip(tensors, got):
        assert m.shape == t.shape and m.is_contiguous() and torch.equal(m, t)
        assert m.data_ptr() % ALIGN_BYTES == 0
    tensors[0].zero_()  # a copy: the originals can go
    assert not torch.equal(got[0], tensors[0])
    got[2][0, 0] = 1e9  # a private mapping: writable, and each view its own
    assert float(got[1]) == float(file_backed([got[1]], tmp_path)[0])


def test_refuses_what_is_not_float32_on_the_cpu(tmp_path):
    with pytest.raises(TypeError, match="float32"):
        file_backed([torch.zeros(4, dtype=torch.float64)], tmp_path)
    assert file_backed([], tmp_path) == [] and list(tmp_path.iterdir()) == []
