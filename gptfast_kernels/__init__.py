"""gptfast_kernels: faster generation for Hugging Face models on NVIDIA GPUs.

int8 weight-only matmul, fused static-KV-cache attention with position scatter and batched
speculative-decoding verification, as torch.library custom ops with CUDA, Triton and CPU kernels,
plus drop-in modules and generation built on them.
"""

__version__ = "0.1.0"

from gptfast_kernels import ops  # noqa: E402
from gptfast_kernels.modules import Int8Linear, quantize_int8_  # noqa: E402

__all__ = ["__version__", "ops", "Int8Linear", "quantize_int8_"]
