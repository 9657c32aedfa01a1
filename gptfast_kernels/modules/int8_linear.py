"""``Int8Linear``: a drop-in replacement for nn.Linear (and GPT-2's Conv1D) with int8 weights."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from gptfast_kernels._extension import usable_backends
from gptfast_kernels.ops._dispatch import FLOAT_DTYPES, check_int
from gptfast_kernels.ops.int8_linear import auto_backend, int8_linear, quantize_int8, run_int8_linear


def _is_conv1d(module: nn.Module) -> bool:
    # transformers' GPT-2 Conv1D stores weight as [in, out]; import lazily (transformers optional).
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return False
    return isinstance(module, Conv1D)


class Int8Linear(nn.Module):
    """y = x @ dequant(qweight).T + bias with per-output-channel int8 weights.

    Buffers: qweight [out_features, in_features] int8, scales [out_features] float32,
    bias [out_features] (activation dtype) or None.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features = check_int("Int8Linear", "in_features", in_features, 1)
        self.out_features = check_int("Int8Linear", "out_features", out_features, 1)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                    device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_float(cls, module: nn.Module, *, linear_subclasses: Iterable[str] = ()) -> "Int8Linear":
        """Quantises an nn.Linear or a transformers Conv1D (weight [in, out]). An nn.Linear subclass with
        a forward of its own is refused unless its class is named in ``linear_subclasses`` (its forward
        computing nn.Linear's product all the same)."""
        if isinstance(module, nn.Linear) and not _plain_linear(module, linear_subclasses):
            raise TypeError(f"Int8Linear.from_float: {type(module).__name__} subclasses nn.Linear with a forward of "
                            "its own (a router, say), which an Int8Linear would drop")
        if isinstance(module, nn.Linear):
            weight = module.weight.detach()
        elif _is_conv1d(module):
            weight = module.weight.detach().t()
        else:
            raise TypeError(f"Int8Linear.from_float: module must be nn.Linear or transformers "
                            f"Conv1D, got {type(module).__name__}")
        out_features, in_features = weight.shape
        bias = module.bias
        new = cls(in_features, out_features, bias=bias is not None, device=weight.device,
                  dtype=weight.dtype)
        qweight, scales = quantize_int8(weight)
        new.qweight.copy_(qweight)
        new.scales.copy_(scales)
        if bias is not None:
            new.bias.copy_(bias.detach())
        return new

    @classmethod
    def concat(cls, modules: Sequence["Int8Linear"]) -> "Int8Linear":
        """One Int8Linear for several that read the same input: its output is theirs concatenated
        along the last dimension (per-channel scales keep every output channel's weights and scale;
        only the float32 summation order may differ, where a GEMM library blocks the wider matrix
        differently), from one kernel launch that streams all their weights."""
        if not modules or not all(isinstance(m, Int8Linear) for m in modules):
            raise TypeError("Int8Linear.concat: modules must be a non-empty sequence of Int8Linear")
        in_features = modules[0].in_features
        if any(m.in_features != in_features for m in modules):
            raise ValueError("Int8Linear.concat: modules must share in_features, got "
                             f"{[m.in_features for m in modules]}")
        biased = [m.bias is not None for m in modules]
        if any(biased) and not all(biased):
            raise ValueError("Int8Linear.concat: either every module has a bias or none has")
        first = modules[0]
        new = cls(in_features, sum(m.out_features for m in modules), bias=all(biased),
                  device=first.qweight.device, dtype=first.bias.dtype if all(biased) else torch.float32)
        new.qweight.copy_(torch.cat([m.qweight for m in modules]))
        new.scales.copy_(torch.cat([m.scales for m in modules]))
        if all(biased):
            new.bias.copy_(torch.cat([m.bias for m in modules]))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The buffers are valid by construction, so a well-formed x skips the wrapper's checks (tens
        # of microseconds per call, on every linear of every decode step); anything else goes
        # through int8_linear, which raises a clear error.
        if (isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES and x.dim() >= 1
                and x.shape[-1] == self.in_features and x.device == self.qweight.device):
            backend = auto_backend(usable_backends(x.device), x.numel() // self.in_features, self.in_features,
                                   self.out_features)
            return run_int8_linear(backend, x, self.qweight, self.scales, self.bias)
        return int8_linear(x, self.qweight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def _plain_linear(module: nn.Module, linear_subclasses: Iterable[str] = ()) -> bool:
    """An nn.Linear whose forward is nn.Linear's (subclasses with a forward of their own, such as
    PhiMoE's router, compute more than x @ W.T + b), or of a class named in ``linear_subclasses``
    (subclasses whose own forward computes the same product: FalconLinear)."""
    return isinstance(module, nn.Linear) and (type(module).forward is nn.Linear.forward
                                              or type(module).__name__ in linear_subclasses)


def _skipped(name: str, skip: Iterable[str]) -> bool:
    # A pattern matches the full dotted name, its last component, or a glob over either.
    leaf = name.rsplit(".", 1)[-1]
    return any(name == pattern or leaf == pattern or fnmatch.fnmatch(name, pattern)
               or fnmatch.fnmatch(leaf, pattern) for pattern in skip)


OUTPUT_HEAD = "lm_head"


def quantize_int8_(model: nn.Module, skip: Iterable[str] = (OUTPUT_HEAD,), *,
                   linear_subclasses: Iterable[str] = ()) -> nn.Module:
    """Replaces every nn.Linear / Conv1D of ``model`` in place with an Int8Linear, except those
    whose dotted name (or last name component) matches a pattern in ``skip``, and nn.Linear
    subclasses with a forward of their own (PhiMoE's router: they stay float) but for those named in
    ``linear_subclasses`` (FalconLinear: its forward is nn.Linear's product). The model's output
    head (``get_output_embeddings()``) also answers to "lm_head", whatever its attribute name
    (GPT-NeoX's is ``embed_out`` before transformers 5.14). Layers whose weight and bias are the same
    tensors (tied weights in distinct modules: Zamba2's shared blocks, one module per use) become one
    Int8Linear, set at each of their names, so the int8 weights are stored once, as the float ones
    were. Returns model."""
    if isinstance(skip, str):
        skip = (skip,)
    skip = tuple(skip)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    skip_head = _skipped(OUTPUT_HEAD, skip)
    targets = [(name, module) for name, module in model.named_modules()
               if name and (_plain_linear(module, linear_subclasses) or _is_conv1d(module))
               and not _skipped(name, skip) and not (skip_head and module is head)]
    converted: dict[tuple[int, int], Int8Linear] = {}  # by (weight, bias) identity
    for name, module in targets:
        key = (id(module.weight), id(module.bias))
        if key not in converted:
            converted[key] = Int8Linear.from_float(module, linear_subclasses=linear_subclasses)
        model.set_submodule(name, converted[key])
    return model
