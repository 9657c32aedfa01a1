"""Generation on the static cache and fused kernels: generate and batched speculative_generate."""

from gptfast_kernels.generation.generate import GenerateOutput, generate
from gptfast_kernels.generation.speculative import SpeculativeOutput, speculative_generate

__all__ = ["GenerateOutput", "SpeculativeOutput", "generate", "speculative_generate"]
