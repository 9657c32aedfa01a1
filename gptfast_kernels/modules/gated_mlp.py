"""``Int8GatedMLP``: a gated MLP (the Llama-like families) whose gate and up projections are one
int8 matmul, so a decode step streams their weights in one kernel launch instead of two."""

from __future__ import annotations

import torch
from torch import nn

from gptfast_kernels.modules.int8_linear import Int8Linear


class GaussianTopK(nn.Module):
    """Gemma 3n's activation sparsity: each row's values minus mean + std * Phi^-1(sparsity) over its
    last dim, negatives zeroed (Phi: the standard normal's CDF), so about a fraction ``sparsity`` of a
    Gaussian row becomes zero. The same operations, in the same dtypes, as transformers'
    Gemma3nTextMLP._gaussian_topk."""

    def __init__(self, sparsity: float):
        super().__init__()
        if not 0.0 < sparsity < 1.0:
            raise ValueError(f"GaussianTopK: sparsity must be in (0, 1), got {sparsity!r}")
        self.sparsity = float(sparsity)
        # float32 as transformers computes it; rounded to the input's dtype per call, as there
        multiplier = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(self.sparsity, dtype=torch.float32))
        self.register_buffer("std_multiplier", multiplier, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = torch.std(x, dim=-1, keepdim=True, unbiased=False)
        cutoff = torch.mean(x, dim=-1, keepdim=True) + std * self.std_multiplier.to(x.dtype)
        return nn.functional.relu(x - cutoff)

    def extra_repr(self) -> str:
        return f"sparsity={self.sparsity}"


class Int8GatedMLP(nn.Module):
    """down_proj(act_fn(gate) * up) with [gate | up] = gate_up_proj(x), the same function as the
    transformers MLP it replaces. gate_up_proj: Int8Linear [2 * intermediate, hidden]. ``sparsify``
    (Gemma 3n's sparse layers: a GaussianTopK) goes over the gate before the activation;
    ``float32_activation`` (Beam's) computes act_fn(gate) * up in float32, rounded back to the
    projections' dtype before down_proj."""

    def __init__(self, gate_up_proj: Int8Linear, down_proj: nn.Module, act_fn: nn.Module,
                 sparsify: nn.Module | None = None, float32_activation: bool = False):
        super().__init__()
        if gate_up_proj.out_features % 2:
            raise ValueError("Int8GatedMLP: gate_up_proj must have an even number of outputs (gate, up), "
                             f"got {gate_up_proj.out_features}")
        self.gate_up_proj, self.down_proj, self.act_fn, self.sparsify = gate_up_proj, down_proj, act_fn, sparsify
        self.float32_activation = float32_activation
        self.intermediate_size = gate_up_proj.out_features // 2

    @classmethod
    def from_mlp(cls, mlp: nn.Module, float32_activation: bool = False) -> "Int8GatedMLP":
        # the activation is act_fn in most families' MLPs, activation_fn in Phi-3-derived ones (Llama 4's)
        act_fn = mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn
        sparsity = getattr(mlp, "activation_sparsity", 0.0)  # Gemma 3n's: 0.0 in its dense layers
        sparsify = GaussianTopK(sparsity).to(mlp.gate_proj.scales.device) if sparsity > 0.0 else None
        return cls(Int8Linear.concat([mlp.gate_proj, mlp.up_proj]), mlp.down_proj, act_fn, sparsify, float32_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        if self.sparsify is not None:
            gate = self.sparsify(gate)
        if self.float32_activation:
            return self.down_proj((self.act_fn(gate.float()) * up.float()).to(gate.dtype))
        return self.down_proj(self.act_fn(gate) * up)


def fuse_gated_mlps_(model: nn.Module, mlp_class: str, float32_activation: bool = False) -> int:
    """Replaces, in place, every module of class name ``mlp_class`` whose gate_proj and up_proj are
    both Int8Linear (neither kept in float by int8_skip) with an Int8GatedMLP (``float32_activation``
    as there), one for the MLPs over the same int8 layers (tied blocks); returns how many MLPs."""
    targets = [(name, module) for name, module in model.named_modules()
               if type(module).__name__ == mlp_class
               and isinstance(getattr(module, "gate_proj", None), Int8Linear)
               and isinstance(getattr(module, "up_proj", None), Int8Linear)]
    fused: dict[tuple[int, int, int], Int8GatedMLP] = {}  # MLPs over the same int8 layers (Zamba's tied blocks)
    for name, module in targets:
        key = (id(module.gate_proj), id(module.up_proj), id(module.down_proj))
        if key not in fused:
            fused[key] = Int8GatedMLP.from_mlp(module, float32_activation)
        model.set_submodule(name, fused[key])
    return len(targets)
