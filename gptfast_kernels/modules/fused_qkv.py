"""Fused q / k / v projections for attention modules that project one input three times
(the Llama-like families): one int8 matmul streams the three weight matrices in one launch, where
the k and v projections of a grouped-query model (1024 x 4096 for Llama-3-8B) are each too small
to keep a GPU busy on their own.

transformers' attention forward still calls ``q_proj``, ``k_proj`` and ``v_proj``; after fusion
they are ``ProjectionPart``s of one ``Int8FusedProjections``: the first call computes all three
outputs and keeps them until the last part has been handed out, so the forward itself is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gptfast_kernels.modules.int8_linear import Int8Linear


class Int8FusedProjections(nn.Module):
    """Several projections of one input as one Int8Linear (``fused``, their weights stacked), whose
    output is split into parts of ``sizes`` features. ``part(x, i)`` computes all parts for x when
    it has not already (a call with another input recomputes) and forgets them once the last part
    is taken, so nothing stays alive between forwards (or in a CUDA graph's memory pool)."""

    def __init__(self, fused: Int8Linear, sizes: Sequence[int]):
        super().__init__()
        if sum(sizes) != fused.out_features:
            raise ValueError(f"Int8FusedProjections: sizes {list(sizes)} must add up to the fused "
                             f"out_features {fused.out_features}")
        self.fused, self.sizes = fused, list(sizes)
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] | None = None

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self._parts is None or x is not self._input:
            self._input, self._parts = x, self.fused(x).split(self.sizes, dim=-1)
        out = self._parts[index]
        if index == len(self.sizes) - 1:
            self._input = self._parts = None
        return out


class ProjectionPart(nn.Module):
    """Stands where one projection was (q_proj, k_proj or v_proj; a recurrent block's input
    projections): part ``index`` of ``owner``'s output. The owner is not a submodule here (the
    attention module holds it as ``qkv_proj``, a recurrent block as ``input_proj``), so its weights
    appear once in the state dict."""

    def __init__(self, owner: Int8FusedProjections, index: int, owner_name: str = "qkv_proj"):
        super().__init__()
        object.__setattr__(self, "owner", owner)
        self.index, self.owner_name = index, owner_name
        self.in_features, self.out_features = owner.fused.in_features, owner.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner.part(x, self.index)

    def extra_repr(self) -> str:
        return (f"part {self.index} of {self.owner_name}, in_features={self.in_features}, "
                f"out_features={self.out_features}")


PROJECTIONS = ("q_proj", "k_proj", "v_proj")
# multi-head latent attention projects its input twice: the query (low-rank q_a_proj, or q_proj) and
# the compressed latent with the shared rotary key
LATENT_PROJECTIONS = (("q_a_proj", "kv_a_proj_with_mqa"), ("q_proj", "kv_a_proj_with_mqa"))


def _projection_names(module: nn.Module) -> list[str]:
    """The projections of ``module``'s one input that it calls in order: q / k / v, or MLA's pair."""
    for names in LATENT_PROJECTIONS:
        if all(getattr(module, name, None) is not None for name in names):
            return list(names)
    return [name for name in PROJECTIONS if not (name == "v_proj" and getattr(module, name, 0) is None)]


def fuse_qkv_(model: nn.Module, attention_class: str, modules: list[nn.Module] | None = None) -> int:
    """In place: every module of class name ``attention_class`` (or every one of ``modules``, when
    given: patch_model passes a family's subclasses too) whose q_proj, k_proj and v_proj are all
    Int8Linear (none kept in float by int8_skip) gets ``qkv_proj``, their fusion, and the three
    become its parts. A module without v_proj (None: Gemma 4's global layers take the keys as
    values) fuses q_proj and k_proj alike, a multi-head latent attention module its query projection
    (q_a_proj or q_proj) and kv_a_proj_with_mqa. Returns how many attention modules were fused."""
    if modules is None:
        modules = [module for module in model.modules() if type(module).__name__ == attention_class]
    fused: dict = {}  # modules whose projections are the same Int8Linears (Zamba2's shared blocks) share one fusion
    return sum(fuse_projections_(module, _projection_names(module), "qkv_proj", fused) for module in modules)


def fuse_projections_(module: nn.Module, names: Sequence[str], owner_name: str, fused: dict | None = None) -> bool:
    """In place: ``module``'s projections ``names`` (of one input, called in that order) become the
    parts of one Int8FusedProjections, set as ``owner_name``, when there are two or more and all are
    Int8Linear. ``fused``: the fusions made so far, by their projections' identities, reused for a module
    whose projections are the same modules. Returns whether it fused them."""
    projections = [getattr(module, name, None) for name in names]
    if len(names) < 2 or not all(isinstance(p, Int8Linear) for p in projections):
        return False
    key = tuple(id(p) for p in projections)
    owner = None if fused is None else fused.get(key)
    if owner is None:
        owner = Int8FusedProjections(Int8Linear.concat(projections), [p.out_features for p in projections])
        if fused is not None:
            fused[key] = owner
    setattr(module, owner_name, owner)
    for index, name in enumerate(names):
        setattr(module, name, ProjectionPart(owner, index, owner_name))
    return True
