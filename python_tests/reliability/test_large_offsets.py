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
