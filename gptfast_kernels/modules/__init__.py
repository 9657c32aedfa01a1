"""Drop-in modules: Int8Linear and StaticKVCache."""

from gptfast_kernels.modules.int8_linear import Int8Linear, quantize_int8_
from gptfast_kernels.modules.static_kv_cache import StaticKVCache

__all__ = ["Int8Linear", "StaticKVCache", "quantize_int8_"]
