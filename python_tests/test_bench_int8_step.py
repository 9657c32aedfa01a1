"""bench_int8_linear's `step` case: a decode step's int8 projections as the patched model runs them
(q / k / v and gate / up fused, then the head), timed together, so its GB/s is the figure the
end-to-end decode rate rests on."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bench import bench_int8_linear
from bench.bench_int8_linear import LLAMA3_8B, SMALL_STEP, StepModel, projection_candidates
from bench.harness import Harness
from gptfast_kernels import ops, patch_model
from gptfast_kernels.modules import Int8Linear


def _llama_config(model: StepModel) -> LlamaConfig:
    head_dim = 32
    heads = model.hidden // head_dim
    kv_heads = (model.qkv // head_dim - heads) // 2
    return LlamaConfig(hidden_size=model.hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, intermediate_size=model.intermediate, vocab_size=model.vocab,
                       num_hidden_layers=model.layers)


def test_step_projections_are_those_a_patched_llama_runs():
    """The (N, K) list is what a patched Llama of those sizes multiplies by, in its order: the step's
    bytes are the model's, not a guess at them."""
    model = AutoModelForCausalLM.from_config(_llama_config(SMALL_STEP)).eval()
    patch_model(model)
    ran = []
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.register_forward_hook(lambda m, args, out: ran.append((m.out_features, m.in_features)))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert ran == SMALL_STEP.projections()


def test_llama3_8b_step_reads_its_int8_weights():
    """129 projections (4 a layer and the head) holding Llama-3-8B's 7.5 GB of int8 weights: every
    matrix but the embedding's."""
    projections = LLAMA3_8B.projections()
    assert len(projections) == 4 * 32 + 1
    weight_bytes = sum(N * K for N, K in projections)
    per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert weight_bytes == 32 * per_layer + 128256 * 4096
    assert 7.4e9 < weight_bytes < 7.6e9


def test_projection_candidates_compute_every_projection():
    """Each projection gets the input of its width; the int8 candidate's outputs are the float ones'
    up to the weights' rounding, and exactly F.linear over the dequantized weights."""
    torch.manual_seed(0)
    M = 3
    inputs = {K: torch.randn(M, K) for K in (SMALL_STEP.hidden, SMALL_STEP.intermediate)}
    weights = [torch.randn(N, K) / K ** 0.5 for N, K in SMALL_STEP.projections()]
    quantized = [ops.quantize_int8(w) for w in weights]
    candidates = projection_candidates(inputs, weights, quantized, "F.linear_float32", "", torch.device("cpu"))
    assert set(candidates) == {"F.linear_float32", "ours_auto"}
    floats, ours = candidates["F.linear_float32"](), candidates["ours_auto"]()
    assert [tuple(y.shape) for y in ours] == [(M, N) for N, _ in SMALL_STEP.projections()]
    for y, want, (q, s), (N, K) in zip(ours, floats, quantized, SMALL_STEP.projections()):
        dequantized = torch.nn.functional.linear(inputs[K], q.float() * s[:, None])
        torch.testing.assert_close(y, dequantized, atol=1e-4, rtol=1e-4)
        assert (y - want).abs().max() < 0.05 * want.abs().max()


def test_step_rows_at_each_batch():
    """--cases step writes one row per candidate and batch, each with the step's whole byte count; with
    one_row only batch 1; `layers` and the per-call cases are not run alongside unless named."""
    h = Harness(torch.device("cpu"), quick=True, cases=frozenset({"step"}))
    bench_int8_linear.run(h)
    assert {(row["M"], row["impl"]) for row in h.rows} == {
        (M, impl) for M in bench_int8_linear.STEP_ROWS for impl in ("F.linear_float32", "ours_auto")}
    assert all(row["step"] == "small" and row["projections"] == 9 and "N" not in row for row in h.rows)
    one = next(row for row in h.rows if row["M"] == 1)
    weight_bytes = sum(N * K for N, K in SMALL_STEP.projections())
    assert one["gbps"] * one["ms_median"] * 1e6 == pytest.approx(
        weight_bytes + sum(4 * N + 4 * (K + N) for N, K in SMALL_STEP.projections()))
    h = Harness(torch.device("cpu"), quick=True, cases=frozenset({"step", "one_row"}))
    bench_int8_linear.run(h)
    assert {row["M"] for row in h.rows} == {1}
