"""``Int8Experts``: the expert layers of a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, GPT-OSS, ...) with int8 weights, a drop-in for transformers' experts modules.

transformers 5.x keeps a MoE layer's experts as two 3-D parameters, gate_up_proj [E, 2I, H] and
down_proj [E, H, I] (GPT-OSS: transposed, [E, H, 2I] and [E, I, H], with biases and gate / up
interleaved; DBRX: three 2-D ones, see ``_has_glu_weights``), behind ``forward(hidden [tokens, H],
top_k_index [tokens, k], top_k_weights [tokens, k])``; the router stays in float (int8 noise there
would change which experts run). The weights are stored [E, out, in] whatever the source layout,
with the gate / up columns in the source's order, and the source's own gating (``_apply_gate``: how
gate and up are split, the activation, GPT-OSS's clamps) runs on the result, so the layouts
transformers' experts interface describes need no per-model code here. Decode and verification steps
(few tokens: the compiled, CUDA-graphed path) run each (token, chosen expert) pair as one row of
``int8_expert_linear``, which streams only the chosen experts' int8 weights, with no host
synchronisation. A prompt (many tokens, eager) runs expert by expert through ``int8_linear``'s tiled
kernels instead, as transformers' own loop does.
"""

from __future__ import annotations

import torch
from torch import nn

from gptfast_kernels.ops._dispatch import is_tracing
from gptfast_kernels.ops.int8_expert_linear import int8_expert_linear
from gptfast_kernels.ops.int8_linear import int8_linear, quantize_int8

# (token, expert) rows above which an eager forward on a GPU groups the rows by expert (one host sync)
# and runs each expert's rows as one tiled int8_linear: the per-row kernel re-reads an expert's weights
# for every few rows routed to it, which only pays while the rows are few (decode, verification).
# The CPU op groups the rows itself (int8_expert_linear.cpp), with the bits int8_linear gives each
# expert's rows, so there the Python loop would only add host work.
GROUPED_MIN_ROWS = 64


def quantize_expert_weights(weight: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float ([E, K, N] if ``transposed``) -> (qweight [E, N, K] int8, scales [E, N]
    float32), per output channel."""
    if transposed:
        weight = weight.transpose(1, 2)
    E, N, K = weight.shape
    qweight, scales = quantize_int8(weight.detach().contiguous().reshape(E * N, K))
    return qweight.view(E, N, K), scales.view(E, N)


def _has_glu_weights(module: nn.Module) -> bool:
    """DBRX's layout: gate, up and down as 2-D parameters of an ``mlp`` submodule, w1 / v1 / w2, each
    [E * I, H] (w2 being down transposed), and its ``activation_fn``."""
    mlp = getattr(module, "mlp", None)
    weights = [getattr(mlp, name, None) for name in ("w1", "v1", "w2")]
    return (all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights)
            and len({w.shape for w in weights}) == 1 and callable(getattr(mlp, "activation_fn", None))
            and isinstance(getattr(module, "num_experts", None), int)
            and weights[0].shape[0] % module.num_experts == 0)


def _glu_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """A DBRX layout's weights (see ``_has_glu_weights``) as (gate_up [E, 2I, H], down [E, H, I],
    the activation)."""
    mlp = module.mlp
    gate, up, down = (w.detach().view(module.num_experts, -1, w.shape[1]) for w in (mlp.w1, mlp.v1, mlp.w2))
    return torch.cat([gate, up], dim=1), down.transpose(1, 2), mlp.activation_fn


class HalvesGating(nn.Module):
    """act_fn(gate) * up on the two halves of [..., 2I] gate / up projections (transformers' default
    gating, for experts modules without an ``_apply_gate``: DBRX's)."""

    def __init__(self, act_fn):
        super().__init__()
        self.act_fn = act_fn

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def _first_projection(module: nn.Module) -> str:
    """The name of an experts module's first weight: gate_up_proj, or up_proj for ungated experts."""
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


class ExpertsGating(nn.Module):
    """The gating of a transformers experts module without its weights: [..., 2I] gate / up
    projections -> [..., I]. Runs the module class's own ``_apply_gate`` (transformers' experts
    interface gives every experts class one: by default act_fn(gate) * up on the two halves;
    GPT-OSS's reads interleaved gate / up, clamps, a sigmoid gate) on a copy of the module's plain
    attributes (alpha, limit, config, ...) and its ``act_fn``; ungated experts (``has_gate`` False:
    up_proj alone, Nemotron-H) get act_fn(up), as transformers' experts interface does."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.apply_gate = getattr(type(module), "_apply_gate", None)
        for name, value in vars(module).items():
            if not name.startswith("_"):  # parameters, buffers and submodules live under _-names
                setattr(self, name, value)
        self.act_fn = getattr(module, "act_fn", None)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "has_gate", True):  # ungated experts (Nemotron-H): the activation of up alone
            return self.act_fn(gate_up)
        return self.apply_gate(self, gate_up)


class Int8Experts(nn.Module):
    """Buffers gate_up_qweight [E, 2I, H] int8 (ungated experts: their up projection, [E, I, H]),
    gate_up_scales [E, 2I], down_qweight [E, H, I] int8, down_scales [E, H] (float32) and, for
    experts with biases, gate_up_bias [E, 2I] and down_bias [E, H] (float, as the source's);
    ``gating`` is the experts' gating (an ExpertsGating). Same function as the module it replaces,
    with its weights rounded to int8."""

    def __init__(self, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
                 gating: nn.Module, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("gate_up_qweight", gate_up[0])
        self.register_buffer("gate_up_scales", gate_up[1])
        self.register_buffer("down_qweight", down[0])
        self.register_buffer("down_scales", down[1])
        self.register_buffer("gate_up_bias", gate_up_bias)
        self.register_buffer("down_bias", down_bias)
        self.gating = gating
        self.num_experts = gate_up[0].shape[0]

    @staticmethod
    def supports(module: nn.Module) -> bool:
        """Whether ``module`` is one Int8Experts reproduces: gate_up_proj / down_proj (either
        orientation, biases or not, any gate / up order its ``_apply_gate`` reads), or for ungated
        experts up_proj / down_proj and an ``act_fn``, and no norm after the experts (transformers'
        experts-interface flags); or DBRX's layout (see ``_has_glu_weights``)."""
        if _has_glu_weights(module):
            return True
        gated, first = getattr(module, "has_gate", True), _first_projection(module)
        return (isinstance(getattr(module, first, None), torch.Tensor)
                and isinstance(getattr(module, "down_proj", None), torch.Tensor)
                and getattr(module, first).dim() == 3 and module.down_proj.dim() == 3
                and (hasattr(type(module), "_apply_gate") if gated else callable(getattr(module, "act_fn", None)))
                and (not getattr(module, "has_bias", False) or (
                    isinstance(getattr(module, f"{first}_bias", None), torch.Tensor)
                    and isinstance(getattr(module, "down_proj_bias", None), torch.Tensor)))
                and not getattr(module, "has_post_expert_norm", False))

    @classmethod
    def from_float(cls, module: nn.Module) -> "Int8Experts":
        if not cls.supports(module):
            raise TypeError(f"Int8Experts.from_float: {type(module).__name__} does not have 3-D gate_up_proj / "
                            "down_proj weights (with both biases if any) and a gating Int8Experts can run")
        if _has_glu_weights(module):
            gate_up, down, act_fn = _glu_weights(module)
            return cls(quantize_expert_weights(gate_up, False), quantize_expert_weights(down, False), HalvesGating(act_fn))
        transposed = getattr(module, "is_transposed", False)
        first = _first_projection(module)
        biases = ((getattr(module, f"{first}_bias").detach(), module.down_proj_bias.detach())
                  if getattr(module, "has_bias", False) else (None, None))
        return cls(quantize_expert_weights(getattr(module, first), transposed),
                   quantize_expert_weights(module.down_proj, transposed), ExpertsGating(module), *biases)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [tokens, H] (or [..., H]: DBRX's are [B, T, H]), top_k_index / top_k_weights
        [tokens, k] -> [tokens, H] (hidden_states' shape)."""
        tokens, top_k = top_k_index.shape
        # row t * k + j: token t, its j-th expert
        rows = hidden_states.reshape(tokens, -1).repeat_interleave(top_k, dim=0)
        out = self.run(rows, top_k_index.reshape(-1))
        weighted = out.float() * top_k_weights.reshape(-1, 1).float()
        return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype).view(hidden_states.shape)

    def run(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """rows [n, H], experts [n] (router ids, valid by construction: not checked) -> [n, H]: each
        row through its expert, unweighted."""
        if rows.shape[0] >= GROUPED_MIN_ROWS and rows.device.type != "cpu" and not is_tracing():
            return self._grouped(rows, experts)
        gate_up = int8_expert_linear(rows, self.gate_up_qweight, self.gate_up_scales, experts, self.gate_up_bias,
                                     check_experts=False)
        return int8_expert_linear(self.gating(gate_up), self.down_qweight, self.down_scales, experts, self.down_bias,
                                  check_experts=False)

    def _grouped(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Eager prompt path on a GPU: each chosen expert's rows through the tiled int8_linear kernels."""
        out = rows.new_zeros(rows.shape[0], self.down_qweight.shape[1])
        order = experts.argsort()
        counts = torch.bincount(experts, minlength=self.num_experts).tolist()  # one host sync
        start = 0
        for expert, count in enumerate(counts[:self.num_experts]):
            if count:
                index = order[start:start + count]
                gate_up = int8_linear(rows[index], self.gate_up_qweight[expert], self.gate_up_scales[expert],
                                      self._bias(self.gate_up_bias, expert))
                out[index] = int8_linear(self.gating(gate_up), self.down_qweight[expert], self.down_scales[expert],
                                         self._bias(self.down_bias, expert))
            start += count
        return out

    @staticmethod
    def _bias(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
        return None if bias is None else bias[expert]


def quantize_experts_(model: nn.Module, experts_class: str | tuple[str, ...]) -> int:
    """Replaces, in place, every module whose class name is ``experts_class`` (or one of them) and
    that Int8Experts supports with an Int8Experts; returns how many."""
    names = (experts_class,) if isinstance(experts_class, str) else tuple(experts_class)
    targets = [(name, module) for name, module in model.named_modules()
               if type(module).__name__ in names and Int8Experts.supports(module)]
    for name, module in targets:
        model.set_submodule(name, Int8Experts.from_float(module))
    return len(targets)
