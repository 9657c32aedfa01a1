"""gptfast_kernels: faster generation for Hugging Face models on NVIDIA GPUs.

int8 weight-only matmul, fused static-KV-cache attention with position scatter and batched
speculative-decoding verification, as torch.library custom ops with CUDA, Triton and CPU kernels,
plus drop-in modules and generation built on them.
"""

__version__ = "0.1.0"

from gptfast_kernels import ops  # noqa: E402
from gptfast_kernels.modules.int8_linear import Int8Linear, quantize_int8_  # noqa: E402

# The Hugging Face integration imports transformers (slow): loaded on first use.
_LAZY = {
    "StaticKVCache": "gptfast_kernels.modules.static_kv_cache",
    "patch_model": "gptfast_kernels.models.patch",
    "generate": "gptfast_kernels.generation.generate",
    "GenerateOutput": "gptfast_kernels.generation.generate",
    "speculative_generate": "gptfast_kernels.generation.speculative",
    "SpeculativeOutput": "gptfast_kernels.generation.speculative",
    "prompt_lookup_generate": "gptfast_kernels.generation.prompt_lookup",
    "ContinuousBatcher": "gptfast_kernels.generation.continuous",
    "SpeculativeBatcher": "gptfast_kernels.generation.continuous_speculative",
    "save_patched": "gptfast_kernels.models.serialization",
    "load_patched": "gptfast_kernels.models.serialization",
}

__all__ = ["__version__", "ops", "Int8Linear", "quantize_int8_", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gptfast_kernels' has no attribute {name!r}")
