"""Bad inputs for every public op. Each case must raise ValueError/TypeError naming the argument;
ops that write in place must leave their caches unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gptfast_kernels import _extension, ops


@dataclass
class Case:
    run: Callable[[], object]
    needle: str                     # must appear in the message: the argument's name
    errors: tuple = (ValueError,)


def _int8(backend="auto", **overrides):
    def run():
        torch.manual_seed(0)
        weight = torch.randn(8, 16)
        qweight, scales = ops.quantize_int8(weight)
        args = dict(x=torch.randn(3, 16), qweight=qweight, scales=scales, bias=torch.randn(8))
        args.update({k: (v() if callable(v) else v) for k, v in overrides.items()})
        return ops.int8_linear(**args, backend=backend)
    return run


def _attention(backend="auto", **overrides):
    """kv_cache_attention with valid defaults replaced by ``overrides``; checks the caches stay
    unchanged when it raises."""
    def run():
        torch.manual_seed(0)
        B, Hq, Hkv, T, D, S = 2, 4, 2, 3, 16, 8
        args = dict(q=torch.randn(B, Hq, T, D), k=torch.randn(B, Hkv, T, D),
                    v=torch.randn(B, Hkv, T, D), k_cache=torch.randn(B, Hkv, S, D),
                    v_cache=torch.randn(B, Hkv, S, D), positions=torch.tensor([[0, 1, 2], [4, 5, 6]]))
        args.update({k: (v(args) if callable(v) else v) for k, v in overrides.items()})
        before = [t.clone() if isinstance(t, torch.Tensor) else t for t in (args["k_cache"], args["v_cache"])]
        try:
            return ops.kv_cache_attention(**args, backend=backend)
        except (ValueError, TypeError):
            for name, old, new in zip(("k_cache", "v_cache"), before, (args["k_cache"], args["v_cache"])):
                if isinstance(new, torch.Tensor) and new.shape == old.shape and not torch.equal(old, new):
                    raise AssertionError(f"{name} was modified by a call that raised")
            raise
    return run


def _verify(backend="auto", sampling=True, **overrides):
    def run():
        torch.manual_seed(0)
        B, k, V = 3, 4, 11
        args = dict(target_probs=torch.softmax(torch.randn(B, k + 1, V), -1),
                    draft_probs=torch.softmax(torch.randn(B, k, V), -1) if sampling else None,
                    draft_tokens=torch.randint(0, V, (B, k)), uniforms=torch.rand(B, k + 1))
        args.update({key: (v(args) if callable(v) else v) for key, v in overrides.items()})
        return ops.verify_draft(**args, backend=backend)
    return run


def _triton(op: str, **overrides):
    """A Triton custom op called directly (torch.ops.gptfast_kernels.<op>_triton), as a user could,
    with valid CPU inputs replaced by ``overrides``: it checks them before any launch (the interpreter
    is never needed), and leaves the caches unchanged."""
    return _direct(op + "_triton", op, **overrides)


def _compiled(op: str, **overrides):
    """The extension's custom op called directly (torch.ops.gptfast_kernels.<op>), as _triton."""
    return _direct(op, op, **overrides)


def _direct(op_name: str, op: str, **overrides):
    """torch.ops.gptfast_kernels.<op_name>, a custom op taking ``op``'s arguments, called with valid
    CPU inputs replaced by ``overrides``."""
    def run():
        import gptfast_kernels.triton.int8_expert_linear  # noqa: F401  (registers the ops)
        import gptfast_kernels.triton.int8_linear  # noqa: F401
        import gptfast_kernels.triton.kv_cache_attention  # noqa: F401
        import gptfast_kernels.triton.verify_draft  # noqa: F401

        torch.manual_seed(0)
        B, Hq, Hkv, T, D, S, V, k, E = 2, 4, 2, 3, 16, 8, 11, 4, 3
        args = {
            "int8_linear": lambda: dict(x=torch.randn(3, 16), qweight=torch.ones(8, 16, dtype=torch.int8),
                                        scales=torch.ones(8), bias=torch.randn(8)),
            "int8_expert_linear": lambda: dict(x=torch.randn(3, 16), qweight=torch.ones(E, 8, 16, dtype=torch.int8),
                                               scales=torch.ones(E, 8), experts=torch.tensor([0, 2, 1]),
                                               bias=torch.randn(E, 8)),
            "verify_draft": lambda: dict(target_probs=torch.softmax(torch.randn(B, k + 1, V), -1),
                                         draft_probs=torch.softmax(torch.randn(B, k, V), -1),
                                         draft_tokens=torch.randint(0, V, (B, k)), uniforms=torch.rand(B, k + 1)),
            "kv_cache_attention": lambda: dict(q=torch.randn(B, Hq, T, D), k=torch.randn(B, Hkv, T, D),
                                               v=torch.randn(B, Hkv, T, D), k_cache=torch.randn(B, Hkv, S, D),
                                               v_cache=torch.randn(B, Hkv, S, D),
                                               positions=torch.tensor([[0, 1, 2], [4, 5, 6]]), scale=0.25,
                                               sinks=torch.zeros(Hq), alibi_slopes=torch.ones(Hq)),
        }[op]()
        args.update({key: (v(args) if callable(v) else v) for key, v in overrides.items()})
        caches = [args[name].clone() for name in ("k_cache", "v_cache") if isinstance(args.get(name), torch.Tensor)]
        try:
            return getattr(torch.ops.gptfast_kernels, op_name)(**args)
        except (ValueError, TypeError):
            if any(not torch.equal(old, args[name]) for old, name in zip(caches, ("k_cache", "v_cache"))
                   if args[name].shape == old.shape):
                raise AssertionError("a cache was modified by a call that raised")
            raise
    return run


def _nan_at(name, value):
    def make(args):
        t = args[name].clone()
        t.view(-1)[1] = value
        return t
    return make


CASES: dict[str, Case] = {
    # int8_linear / quantize_int8
    "int8_x_int_dtype": Case(_int8(x=lambda: torch.ones(3, 16, dtype=torch.int32)), "x"),
    "int8_x_float64": Case(_int8(x=lambda: torch.randn(3, 16, dtype=torch.float64)), "x"),
    "int8_x_scalar": Case(_int8(x=lambda: torch.tensor(1.0)), "x"),
    "int8_k_mismatch": Case(_int8(x=lambda: torch.randn(3, 15)), "x"),
    "int8_qweight_float": Case(_int8(qweight=lambda: torch.randn(8, 16)), "qweight"),
    "int8_qweight_3d": Case(_int8(qweight=lambda: torch.zeros(1, 8, 16, dtype=torch.int8)), "qweight"),
    "int8_k_zero": Case(_int8(x=lambda: torch.randn(3, 0), qweight=lambda: torch.zeros(8, 0, dtype=torch.int8)),
                        "qweight"),
    "int8_scales_shape": Case(_int8(scales=lambda: torch.ones(7)), "scales"),
    "int8_scales_int": Case(_int8(scales=lambda: torch.ones(8, dtype=torch.int32)), "scales"),
    "int8_bias_shape": Case(_int8(bias=lambda: torch.ones(9)), "bias"),
    "int8_bias_2d": Case(_int8(bias=lambda: torch.ones(1, 8)), "bias"),
    "int8_mixed_devices": Case(_int8(x=lambda: torch.randn(3, 16, device="meta")), "x"),
    "int8_not_a_tensor": Case(_int8(x=lambda: [[0.0] * 16]), "x", (TypeError,)),
    "int8_bad_backend": Case(_int8(backend="gpu"), "backend"),
    "quantize_k_zero": Case(lambda: ops.quantize_int8(torch.randn(4, 0)), "weight"),
    "quantize_int_weight": Case(lambda: ops.quantize_int8(torch.ones(4, 4, dtype=torch.int64)), "weight"),
    "quantize_1d": Case(lambda: ops.quantize_int8(torch.randn(4)), "weight"),
    # kv_cache_attention
    "attn_position_eq_S": Case(_attention(positions=lambda a: torch.tensor([[0, 1, 2], [6, 7, 8]])), "positions"),
    "attn_position_huge": Case(_attention(positions=lambda a: torch.tensor([[0, 1, 2**40], [0, 1, 2]])), "positions"),
    "attn_position_below_minus_one": Case(_attention(positions=lambda a: torch.tensor([[0, 1, -2], [0, 1, 2]])),
                                          "positions"),
    "attn_position_repeated": Case(_attention(positions=lambda a: torch.tensor([[0, 1, 1], [0, 1, 2]])), "positions"),
    "attn_positions_float": Case(_attention(positions=lambda a: torch.tensor([[0.0, 1, 2], [0, 1, 2]])), "positions"),
    "attn_positions_shape": Case(_attention(positions=lambda a: torch.tensor([[0, 1], [0, 1]])), "positions"),
    "attn_q_int": Case(_attention(q=lambda a: a["q"].to(torch.int32)), "q"),
    "attn_k_dtype": Case(_attention(k=lambda a: a["k"].half()), "k"),
    "attn_cache_dtype": Case(_attention(v_cache=lambda a: a["v_cache"].half()), "v_cache"),
    "attn_gqa_ratio": Case(_attention(q=lambda a: torch.randn(2, 3, 3, 16)), "Hq"),
    # no query heads: the kernels would return at once, leaving the new k / v unwritten
    "attn_no_query_heads": Case(_attention(q=lambda a: torch.randn(2, 0, 3, 16)), "Hq"),
    "attn_cache_heads": Case(_attention(k_cache=lambda a: torch.randn(2, 1, 8, 16)), "k_cache"),
    "attn_cache_batch": Case(_attention(v_cache=lambda a: torch.randn(3, 2, 8, 16)), "v_cache"),
    "attn_cache_head_dim": Case(_attention(k_cache=lambda a: torch.randn(2, 2, 8, 8)), "k_cache"),
    "attn_cache_non_contiguous": Case(_attention(k_cache=lambda a: torch.randn(2, 2, 16, 8).transpose(2, 3)),
                                      "k_cache"),
    "attn_q_3d": Case(_attention(q=lambda a: a["q"][0]), "q"),
    # one past MAX_HEAD_DIM = 576
    "attn_head_dim_too_big": Case(_attention(q=lambda a: torch.randn(2, 4, 3, 577), k=lambda a: torch.randn(2, 2, 3, 577),
                                             v=lambda a: torch.randn(2, 2, 3, 577), k_cache=lambda a: torch.randn(2, 2, 8, 577),
                                             v_cache=lambda a: torch.randn(2, 2, 8, 577)), "D"),
    "attn_scale_nan": Case(_attention(scale=float("nan")), "scale"),
    "attn_scale_bool": Case(_attention(scale=True), "scale"),
    "attn_scale_int_past_float": Case(_attention(scale=10**400), "scale"),  # float(10**400) overflows
    # finite in Python, inf in the kernels' float32
    "attn_scale_inf_in_float32": Case(_attention(scale=1e39), "scale"),
    "attn_softcap_inf_in_float32": Case(_attention(softcap=1e39), "softcap"),
    "attn_chunk_size_zero": Case(_attention(chunk_size=0), "chunk_size"),
    "attn_chunk_size_with_window": Case(_attention(chunk_size=4, window=2), "chunk_size"),
    # a ring (S = 8 slots) for chunks it cannot hold, and rows spanning 2 positions, more than S - chunk_size = 1
    "attn_ring_chunk_size_too_long": Case(_attention(chunk_size=9, ring=True), "chunk_size"),
    "attn_ring_chunk_span": Case(_attention(chunk_size=7, ring=True), "chunk_size"),
    "attn_mixed_devices": Case(_attention(positions=lambda a: a["positions"].to("meta")), "positions"),
    # verify_draft
    "verify_nan_target": Case(_verify(target_probs=_nan_at("target_probs", float("nan"))), "target_probs"),
    "verify_inf_draft": Case(_verify(draft_probs=_nan_at("draft_probs", float("inf"))), "draft_probs"),
    "verify_negative_target": Case(_verify(target_probs=_nan_at("target_probs", -0.5)), "target_probs"),
    "verify_token_too_big": Case(_verify(draft_tokens=lambda a: torch.full((3, 4), 11)), "draft_tokens"),
    "verify_token_negative": Case(_verify(draft_tokens=lambda a: torch.full((3, 4), -1)), "draft_tokens"),
    "verify_greedy_token_too_big": Case(_verify(sampling=False, draft_tokens=lambda a: torch.full((3, 4), 2**40)),
                                        "draft_tokens"),
    "verify_uniform_one": Case(_verify(uniforms=lambda a: torch.ones(3, 5)), "uniforms"),
    "verify_uniform_negative": Case(_verify(uniforms=lambda a: -torch.rand(3, 5)), "uniforms"),
    "verify_target_float64": Case(_verify(target_probs=lambda a: a["target_probs"].double()), "target_probs"),
    "verify_tokens_int32": Case(_verify(draft_tokens=lambda a: a["draft_tokens"].int()), "draft_tokens"),
    "verify_draft_shape": Case(_verify(draft_probs=lambda a: a["draft_probs"][:, :3]), "draft_probs"),
    "verify_vocab_mismatch": Case(_verify(draft_probs=lambda a: torch.softmax(torch.randn(3, 4, 12), -1)),
                                  "draft_probs"),
    "verify_tokens_shape": Case(_verify(draft_tokens=lambda a: a["draft_tokens"][:, :2]), "draft_tokens"),
    "verify_uniforms_shape": Case(_verify(uniforms=lambda a: torch.rand(3, 4)), "uniforms"),
    "verify_target_2d": Case(_verify(target_probs=lambda a: a["target_probs"][0]), "target_probs"),
    # finite weights whose rows' float32 sums overflow: sampling's inverse CDF would read past them
    "verify_target_rows_overflow": Case(_verify(target_probs=lambda a: torch.full((3, 5, 11), 3e38)), "target_probs"),
    "verify_generator_type": Case(_verify(generator="seed"), "generator", (TypeError,)),
    # the Triton custom ops called directly: their kernels index by shape alone, so each checks its inputs
    "triton_int8_x_3d": Case(_triton("int8_linear", x=lambda a: a["x"][None]), "x"),
    "triton_int8_k_mismatch": Case(_triton("int8_linear", x=lambda a: torch.randn(3, 15)), "x"),
    "triton_int8_scales_half": Case(_triton("int8_linear", scales=lambda a: a["scales"].half()), "scales"),
    "triton_int8_qweight_strided": Case(_triton("int8_linear", qweight=lambda a: torch.ones(16, 8, dtype=torch.int8).T),
                                        "qweight"),
    "triton_int8_bias_shape": Case(_triton("int8_linear", bias=lambda a: torch.randn(9)), "bias"),
    "triton_experts_int32": Case(_triton("int8_expert_linear", experts=lambda a: a["experts"].int()), "experts"),
    "triton_experts_scales_strided": Case(_triton("int8_expert_linear", scales=lambda a: torch.ones(8, 3).T),
                                          "scales"),
    "triton_experts_bias_dtype": Case(_triton("int8_expert_linear", bias=lambda a: a["bias"].double()), "bias"),
    "triton_experts_qweight_shape": Case(_triton("int8_expert_linear",
                                                 qweight=lambda a: torch.ones(3, 8, 15, dtype=torch.int8)), "x"),
    "triton_verify_uniforms_none": Case(_triton("verify_draft", uniforms=None), "uniforms", (TypeError,)),
    "triton_verify_target_strided": Case(_triton("verify_draft", target_probs=lambda a: torch.softmax(
        torch.randn(2, 11, 5), 1).transpose(1, 2)), "target_probs"),
    "triton_verify_tokens_shape": Case(_triton("verify_draft", draft_tokens=lambda a: a["draft_tokens"][:, :3]),
                                       "draft_tokens"),
    "triton_attn_sinks_short": Case(_triton("kv_cache_attention", sinks=lambda a: torch.zeros(3)), "sinks"),
    "triton_attn_sinks_strided": Case(_triton("kv_cache_attention", sinks=lambda a: torch.zeros(8)[::2]), "sinks"),
    "triton_attn_alibi_float64": Case(_triton("kv_cache_attention", alibi_slopes=lambda a: torch.ones(4).double()),
                                      "alibi_slopes"),
    "triton_attn_positions_1d": Case(_triton("kv_cache_attention", positions=lambda a: torch.tensor([0, 1, 2])),
                                     "positions"),
    "triton_attn_positions_int32": Case(_triton("kv_cache_attention", positions=lambda a: a["positions"].int()),
                                        "positions"),
    "triton_attn_cache_heads": Case(_triton("kv_cache_attention", k_cache=lambda a: torch.randn(2, 1, 8, 16)),
                                    "k_cache"),
    "triton_attn_window_negative": Case(_triton("kv_cache_attention", window=-1), "window"),
    "triton_attn_value_dim_too_big": Case(_triton("kv_cache_attention", value_dim=17), "value_dim"),
    "triton_attn_q_head_dim_strided": Case(_triton("kv_cache_attention",
                                                   q=lambda a: torch.randn(2, 4, 16, 3).transpose(2, 3)), "q"),
    "triton_attn_ring_without_window": Case(_triton("kv_cache_attention", ring=True), "ring"),
}

# The custom ops with one argument on meta: their fake implementations (also their Meta kernels, which
# such a call reaches) must raise, not hand back uninitialised memory.
_META_CASES = {
    "int8_linear": ("scales", lambda a: a["scales"].to("meta")),
    "verify_draft": ("uniforms", lambda a: a["uniforms"].to("meta")),
    "kv_cache_attention": ("positions", lambda a: a["positions"].to("meta")),
    "int8_expert_linear": ("experts", lambda a: a["experts"].to("meta")),
}
for _op, (_name, _meta) in _META_CASES.items():
    CASES[f"triton_{_op}_{_name}_meta"] = Case(_triton(_op, **{_name: _meta}), _name)
    if _extension.has_kernel(_op, "CPU"):
        CASES[f"compiled_{_op}_{_name}_meta"] = Case(_compiled(_op, **{_name: _meta}), _name)
