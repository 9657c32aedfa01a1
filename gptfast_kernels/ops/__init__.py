"""The ops (API.md section 1): input checks, backend choice and fake impls over the compiled
(CPU / CUDA), Triton and reference implementations."""

from gptfast_kernels.ops._dispatch import BACKENDS
from gptfast_kernels.ops.int8_expert_linear import int8_expert_linear
from gptfast_kernels.ops.int8_linear import int8_linear, quantize_int8
from gptfast_kernels.ops.kv_cache_attention import kv_cache_attention
from gptfast_kernels.ops.verify_draft import verify_draft

__all__ = ["BACKENDS", "int8_expert_linear", "int8_linear", "kv_cache_attention", "quantize_int8", "verify_draft"]
