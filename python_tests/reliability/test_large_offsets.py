"""Indexing past 2**31 elements (the overflow flash-attention #772 and vLLM's sampler shipped).

The tensors are allocated with torch.empty and only the few entries the kernel needs are written:
untouched pages are never backed by memory, so these run in little RSS on a 24 GiB machine.
"""

import pytest
import torch

from gptfast_kernels import _extension

INT32_LIMIT = 2**31


@pytest.mark.skipif(not _extension.has_kernel("verify_draft", "CPU"), reason="extension not built")
def test_verify_draft_cpu_rows_past_int32_offsets():
    B, k, V = 2, 1, 2**30 + 3
    target = torch.empty(B, k + 1, V)  # 16 GiB virtual; row b = 1 starts past 2**31 elements
    assert target[1, 1].storage_offset() > INT32_LIMIT
    # greedy reads whole rows: give every row it reads one clear maximum, zeros elsewhere
    for b, (draft_token, bonus_token) in enumerate([(5, 11), (V - 2, V - 7)]):
        target[b, 0, draft_token] = 1.0
        target[b, 1, bonus_token] = 1.0
    draft_tokens = torch.tensor([[5], [V - 2]])
    uniforms = torch.zeros(B, k + 1)
    tokens, num = torch.ops.gptfast_kernels.verify_draft(target, None, draft_tokens, uniforms)
    assert num.tolist() == [2, 2]
    assert tokens.tolist() == [[5, 11], [V - 2, V - 7]]


@pytest.mark.skipif(not _extension.has_kernel("kv_cache_attention", "CPU"), reason="extension not built")
def test_kv_cache_attention_cpu_rows_past_int32_offsets():
    """Caches whose second batch row starts past 2**31 elements: row 1's write and attention must
    land there, not at an offset wrapped around 2**32 (which would hit row 0's slots)."""
    B, H, D = 2, 1, 64
    S = INT32_LIMIT // D + 5  # row 1 of each cache starts at S * D > 2**31 elements
    k_cache = torch.empty(B, H, S, D, dtype=torch.float16)  # 2 x 4 GiB virtual, a few pages touched
    v_cache = torch.empty(B, H, S, D, dtype=torch.float16)
    assert k_cache[1].storage_offset() > INT32_LIMIT
    for cache in (k_cache, v_cache):
        cache[:, :, :2].zero_()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, 1, D, generator=g).half() for _ in range(3))
    out = torch.ops.gptfast_kernels.kv_cache_attention(q, k, v, k_cache, v_cache, torch.tensor([[1], [1]]),
                                                       D ** -0.5)
    for b in range(B):  # each row attends its zero slot 0 and its new slot 1
        assert torch.equal(k_cache[b, :, 1], k[b, :, 0]) and torch.equal(v_cache[b, :, 1], v[b, :, 0])
        scores = torch.stack([torch.zeros(()), (q[b, 0, 0].float() @ k[b, 0, 0].float()) * D ** -0.5])
        want = torch.softmax(scores, 0)[1] * v[b, 0, 0].float()
        torch.testing.assert_close(out[b, 0, 0].float(), want, atol=2e-3, rtol=2e-3)
