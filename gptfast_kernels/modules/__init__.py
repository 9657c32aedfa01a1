"""Drop-in modules: Int8Linear, Int8GatedMLP, Int8FusedProjections, Int8Experts and StaticKVCache
(loaded on first use: it imports transformers)."""

from gptfast_kernels.modules.fused_qkv import Int8FusedProjections, fuse_qkv_
from gptfast_kernels.modules.gated_mlp import Int8GatedMLP, fuse_gated_mlps_
from gptfast_kernels.modules.int8_experts import Int8Experts, quantize_experts_
from gptfast_kernels.modules.int8_linear import Int8Linear, quantize_int8_

__all__ = ["Int8Experts", "Int8FusedProjections", "Int8GatedMLP", "Int8Linear", "StaticKVCache", "fuse_gated_mlps_",
           "fuse_qkv_", "quantize_experts_", "quantize_int8_"]


def __getattr__(name: str):
    if name == "StaticKVCache":
        from gptfast_kernels.modules.static_kv_cache import StaticKVCache

        return StaticKVCache
    raise AttributeError(f"module 'gptfast_kernels.modules' has no attribute {name!r}")
