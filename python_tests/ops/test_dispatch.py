"""backend="auto" picks, by shape, between the CUDA kernel and Triton on a GPU (the thresholds come
from H100 measurements in bench/results), and the compiled CPU kernel on a CPU."""

import os

import pytest

from gptfast_kernels import _extension
from gptfast_kernels.ops.int8_linear import auto_backend as int8_auto
from gptfast_kernels.ops.kv_cache_attention import auto_backend as kv_auto

GPU = ["reference", "cuda", "triton"]
CPU = ["reference", "cpu"]


@pytest.mark.parametrize("rows, K, N, want", [
    (1, 4096, 4096, "cuda"), (1, 4096, 14336, "cuda"), (1, 14336, 4096, "cuda"),  # decode GEMV
    (4, 4096, 4096, "cuda"), (8, 14336, 4096, "cuda"), (16, 14336, 4096, "cuda"),  # a few rows, K >= N
    (4, 4096, 14336, "triton"), (16, 4096, 14336, "triton"),  # a few rows of many short weight rows
    (17, 4096, 4096, "triton"), (40, 14336, 4096, "triton"), (256, 4096, 4096, "triton"),
])
def test_int8_linear_auto_on_gpu(rows, K, N, want):
    assert int8_auto(GPU, rows, K, N) == want


@pytest.mark.parametrize("head_rows, T, S, want", [
    (8, 1, 32768, "cuda"), (8, 5, 8192, "cuda"),     # one row of Llama-3's 8 kv heads
    (8, 5, 32768, "triton"),                         # verification over a long cache
    (16, 1, 4096, "triton"), (256, 5, 8192, "triton"), (64, 1, 8192, "triton"),
    # short caches: the CUDA kernel at any batch for decode, up to 64 head rows for verification
    (256, 1, 2048, "cuda"), (64, 5, 2048, "cuda"), (256, 5, 2048, "triton"),
])
def test_kv_cache_attention_auto_on_gpu(head_rows, T, S, want):
    assert kv_auto(GPU, head_rows, T, S) == want


@pytest.mark.parametrize("head_rows, T, S", [(8, 1, 32768), (8, 5, 8192), (256, 1, 2048), (64, 5, 2048)])
def test_kv_cache_attention_auto_in_cuda_graphs(head_rows, T, S):
    """Compiled or captured, the kernels run as graph replays, where Triton was the faster in every
    case timed at D = 128 (its eager time is mostly its host launcher); larger heads keep the eager
    rule."""
    assert kv_auto(GPU, head_rows, T, S, head_dim=128, graphed=True) == "triton"
    assert kv_auto(GPU, head_rows, T, S, head_dim=576, graphed=True) == kv_auto(GPU, head_rows, T, S)
    assert kv_auto(CPU, head_rows, T, S, graphed=True) == "cpu"


@pytest.mark.parametrize("usable, want", [
    (CPU, "cpu"), (["reference", "cpu", "triton"], "cpu"), (["reference", "cuda"], "cuda"),
    (["reference", "triton"], "triton"), (["reference"], "reference"),
])
def test_auto_without_a_choice(usable, want):
    """Where only one kernel backend can run, every shape gets it."""
    for rows in (1, 64):
        assert int8_auto(usable, rows, 4096, 4096) == want
    for head_rows in (1, 256):
        assert kv_auto(usable, head_rows, 5, 32768) == want


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1" or not _extension.triton_available(),
                    reason="the Triton backend on the CPU needs the Triton interpreter")
def test_triton_backends_under_fake_tensors_take_the_registered_ops():
    """Under FakeTensorMode (tensors without data) the public ops skip their value checks and call
    their Triton kernels through the registered custom ops, whose fake implementations give the
    outputs' shapes; the unchecked launchers they use in plain eager mode would run on no data."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gptfast_kernels import ops

    qweight, scales = ops.quantize_int8(torch.randn(8, 16))
    real = dict(x=torch.randn(3, 16), q=torch.randn(2, 4, 3, 16), k=torch.randn(2, 2, 3, 16),
                cache=torch.randn(2, 2, 8, 16), positions=torch.tensor([[0, 1, 2], [4, 5, 6]]),
                probs=torch.softmax(torch.randn(2, 5, 11), -1), drafts=torch.randint(0, 11, (2, 4)),
                qweights=qweight[None].repeat(3, 1, 1), expert_scales=scales[None].repeat(3, 1))
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(t) for name, t in real.items()}
        qw, sc = mode.from_tensor(qweight), mode.from_tensor(scales)
        outputs = [
            (ops.int8_linear(fake["x"], qw, sc, backend="triton"), (3, 8)),
            (ops.int8_expert_linear(fake["x"], fake["qweights"], fake["expert_scales"],
                                    mode.from_tensor(torch.tensor([0, 2, 1])), backend="triton"), (3, 8)),
            (ops.kv_cache_attention(fake["q"], fake["k"], fake["k"], fake["cache"], fake["cache"].clone(),
                                    fake["positions"], backend="triton"), (2, 4, 3, 16)),
            (ops.verify_draft(fake["probs"], None, fake["drafts"], backend="triton")[0], (2, 5)),
        ]
    for out, shape in outputs:
        assert type(out).__name__ == "FakeTensor" and tuple(out.shape) == shape
