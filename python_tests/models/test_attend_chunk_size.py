"""The patched attention's kernel call (models/attention.py: _attend) passes chunk_size on to
kv_cache_attention, and its memo of checked call signatures keeps calls with different chunk sizes
apart (a chunked call must never reuse an unchunked call's checks, nor the reverse)."""

from types import SimpleNamespace

import pytest
import torch

from gptfast_kernels import ops
from gptfast_kernels.models import attention

TOL = dict(atol=2e-5, rtol=1e-4)


def _layer(B=2, Hkv=2, S=16, D=16):
    """The cache-layer fields _attend reads: key / value buffers, no values in the keys, the memo."""
    return SimpleNamespace(keys=torch.zeros(B, Hkv, S, D), values=torch.zeros(B, Hkv, S, D), value_dim=None,
                           checked_calls={})


def test_chunk_size_reaches_the_kernel_and_the_memo():
    layer = _layer()
    g = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(2, 2, 3, 16, generator=g) for _ in range(3))
    positions = torch.tensor([[2, 3, 4], [7, 8, 9]])  # each row crosses a boundary of 4-slot chunks

    def attend(chunk_size):
        return attention._attend(layer, q, k, v, positions, None, None, None, None, False, "auto", chunk_size)

    unchunked, chunked, chunked_again = attend(None), attend(4), attend(4)
    want = ops.kv_cache_attention(q, k, v, torch.zeros_like(layer.keys), torch.zeros_like(layer.values), positions,
                                  chunk_size=4, backend="reference")
    torch.testing.assert_close(chunked, want, **TOL)
    torch.testing.assert_close(chunked_again, want, **TOL)
    assert not torch.allclose(unchunked, chunked)
    assert len(layer.checked_calls) == 2  # one signature per chunk size
    with pytest.raises(ValueError, match="chunk_size"):
        attention._attend(layer, q, k, v, positions, None, 8, None, None, False, "auto", 4)  # with a window
    with pytest.raises(ValueError, match="chunk_size"):
        attend(0)
