"""Drop-in modules: Int8Linear and (from the attention work) StaticKVCache."""

from gptfast_kernels.modules.int8_linear import Int8Linear, quantize_int8_

__all__ = ["Int8Linear", "quantize_int8_"]
