"""Generation on the static cache and fused kernels: generate, batched speculative_generate (a draft
model proposes) and prompt_lookup_generate (the text itself proposes)."""

from gptfast_kernels.generation.forward import forget_compiled, forget_kept
from gptfast_kernels.generation.generate import GenerateOutput, generate
from gptfast_kernels.generation.prompt_lookup import prompt_lookup_generate
from gptfast_kernels.generation.speculative import SpeculativeOutput, speculative_generate

__all__ = ["GenerateOutput", "SpeculativeOutput", "forget_compiled", "forget_kept", "generate",
           "prompt_lookup_generate", "speculative_generate"]
