"""``Int8Experts``: the expert layers of a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE) with int8 weights, a drop-in for transformers' experts modules.

transformers 5.x keeps a MoE layer's experts as two 3-D parameters, gate_up_proj [E, 2I, H] and
down_proj [E, H, I], behind ``forward(hidden [tokens, H], top_k_index [tokens, k], top_k_weights
[tokens, k])``; the router stays in float (int8 noise there would change which experts run). Decode
and verification steps (few tokens: the compiled, CUDA-graphed path) run each (token, chosen expert)
pair as one row of ``int8_expert_linear``, which streams only the chosen experts' int8 weights, with
no host synchronisation. A prompt (many tokens, eager) runs expert by expert through ``int8_linear``'s
tiled kernels instead, as transformers' own loop does.
"""

from __future__ import annotations

import torch
from torch import nn

from gptfast_kernels.ops._dispatch import is_tracing
from gptfast_kernels.ops.int8_expert_linear import int8_expert_linear
from gptfast_kernels.ops.int8_linear import int8_linear, quantize_int8

# (token, expert) rows above which an eager forward groups the rows by expert (one host sync) and
# runs each expert's rows as one tiled int8_linear: the per-row kernel re-reads an expert's weights
# for every few rows routed to it, which only pays while the rows are few (decode, verification).
GROUPED_MIN_ROWS = 64


def _quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (qweight [E, N, K] int8, scales [E, N] float32), per output channel."""
    E, N, K = weight.shape
    qweight, scales = quantize_int8(weight.detach().reshape(E * N, K))
    return qweight.view(E, N, K), scales.view(E, N)


class Int8Experts(nn.Module):
    """Buffers gate_up_qweight [E, 2I, H] int8, gate_up_scales [E, 2I], down_qweight [E, H, I] int8,
    down_scales [E, H] (float32); act_fn is the experts' activation. Same function as the module
    it replaces, with its weights rounded to int8."""

    def __init__(self, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
                 act_fn: nn.Module):
        super().__init__()
        self.register_buffer("gate_up_qweight", gate_up[0])
        self.register_buffer("gate_up_scales", gate_up[1])
        self.register_buffer("down_qweight", down[0])
        self.register_buffer("down_scales", down[1])
        self.act_fn = act_fn
        self.num_experts = gate_up[0].shape[0]
        self.intermediate_size = gate_up[0].shape[1] // 2

    @staticmethod
    def supports(module: nn.Module) -> bool:
        """Whether ``module`` has the layout Int8Experts reproduces: concatenated [gate; up], weights
        [out, in], no biases and no norm after the experts (transformers' experts-interface flags)."""
        return (isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
                and isinstance(getattr(module, "down_proj", None), torch.Tensor)
                and module.gate_up_proj.dim() == 3 and getattr(module, "has_gate", True)
                and not getattr(module, "has_bias", False) and not getattr(module, "is_transposed", False)
                and getattr(module, "is_concatenated", True) and not getattr(module, "has_post_expert_norm", False))

    @classmethod
    def from_float(cls, module: nn.Module) -> "Int8Experts":
        if not cls.supports(module):
            raise TypeError(f"Int8Experts.from_float: {type(module).__name__} does not have the concatenated, "
                            "untransposed, bias-free gate_up_proj / down_proj layout")
        return cls(_quantize_experts(module.gate_up_proj), _quantize_experts(module.down_proj), module.act_fn)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        rows = hidden_states.repeat_interleave(top_k, dim=0)  # row t * k + j: token t, its j-th expert
        if rows.shape[0] >= GROUPED_MIN_ROWS and not is_tracing():
            out = self._grouped(rows, experts)
        else:
            gate_up = int8_expert_linear(rows, self.gate_up_qweight, self.gate_up_scales, experts,
                                         check_experts=False)  # router ids: valid by construction
            out = int8_expert_linear(self._gate(gate_up), self.down_qweight, self.down_scales, experts,
                                     check_experts=False)
        weighted = out.float() * top_k_weights.reshape(-1, 1).float()
        return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.act_fn(gate) * up

    def _grouped(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Eager prompt path: each chosen expert's rows through the tiled int8_linear kernels."""
        out = rows.new_zeros(rows.shape[0], self.down_qweight.shape[1])
        order = experts.argsort()
        counts = torch.bincount(experts, minlength=self.num_experts).tolist()  # one host sync
        start = 0
        for expert, count in enumerate(counts[:self.num_experts]):
            if count:
                index = order[start:start + count]
                gate_up = int8_linear(rows[index], self.gate_up_qweight[expert], self.gate_up_scales[expert])
                out[index] = int8_linear(self._gate(gate_up), self.down_qweight[expert], self.down_scales[expert])
            start += count
        return out


def quantize_experts_(model: nn.Module, experts_class: str | tuple[str, ...]) -> int:
    """Replaces, in place, every module whose class name is ``experts_class`` (or one of them) and
    that Int8Experts supports with an Int8Experts; returns how many."""
    names = (experts_class,) if isinstance(experts_class, str) else tuple(experts_class)
    targets = [(name, module) for name, module in model.named_modules()
               if type(module).__name__ in names and Int8Experts.supports(module)]
    for name, module in targets:
        model.set_submodule(name, Int8Experts.from_float(module))
    return len(targets)
