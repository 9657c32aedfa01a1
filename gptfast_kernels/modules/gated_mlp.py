"""``Int8GatedMLP``: a gated MLP (the Llama-like families) whose gate and up projections are one
int8 matmul, so a decode step streams their weights in one kernel launch instead of two."""

from __future__ import annotations

import torch
from torch import nn

from gptfast_kernels.modules.int8_linear import Int8Linear


class Int8GatedMLP(nn.Module):
    """down_proj(act_fn(gate) * up) with [gate | up] = gate_up_proj(x), the same function as the
    transformers MLP it replaces. gate_up_proj: Int8Linear [2 * intermediate, hidden]."""

    def __init__(self, gate_up_proj: Int8Linear, down_proj: nn.Module, act_fn: nn.Module):
        super().__init__()
        if gate_up_proj.out_features % 2:
            raise ValueError("Int8GatedMLP: gate_up_proj must have an even number of outputs (gate, up), "
                             f"got {gate_up_proj.out_features}")
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up_proj, down_proj, act_fn
        self.intermediate_size = gate_up_proj.out_features // 2

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> "Int8GatedMLP":
        # the activation is act_fn in most families' MLPs, activation_fn in Phi-3-derived ones (Llama 4's)
        act_fn = mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn
        return cls(Int8Linear.concat([mlp.gate_proj, mlp.up_proj]), mlp.down_proj, act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def fuse_gated_mlps_(model: nn.Module, mlp_class: str) -> int:
    """Replaces, in place, every module of class name ``mlp_class`` whose gate_proj and up_proj are
    both Int8Linear (neither kept in float by int8_skip) with an Int8GatedMLP; returns how many."""
    targets = [(name, module) for name, module in model.named_modules()
               if type(module).__name__ == mlp_class
               and isinstance(getattr(module, "gate_proj", None), Int8Linear)
               and isinstance(getattr(module, "up_proj", None), Int8Linear)]
    for name, module in targets:
        model.set_submodule(name, Int8GatedMLP.from_mlp(module))
    return len(targets)
