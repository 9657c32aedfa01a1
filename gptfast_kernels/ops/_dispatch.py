"""Backend selection and the input checks shared by every op wrapper."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from gptfast_kernels import _extension

BACKENDS = ("auto", "cuda", "triton", "cpu", "reference")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_backend(op: str, backend: str, device: torch.device,
                    auto: Callable[[list[str]], str] | None = None) -> str:
    """Turns ``backend`` into a concrete backend usable on ``device``.

    ``auto`` picks among the usable backends for "auto"; by default the compiled kernel for the
    device (cuda / cpu), then Triton, then the reference.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    usable = _extension.usable_backends(device)
    if backend == "auto":
        return auto(usable) if auto is not None else default_backend(usable)
    if backend not in usable:
        raise ValueError(
            f"{op}: backend={backend!r} is not usable for {device.type} tensors here "
            f"(usable: {usable}; see `python -m gptfast_kernels info`)")
    return backend


def default_backend(usable: Sequence[str]) -> str:
    """The compiled kernel for the device (cuda / cpu), then Triton, then the reference."""
    return next(b for b in ("cuda", "cpu", "triton", "reference") if b in usable)


def gpu_backend(usable: Sequence[str], prefer_cuda: bool) -> str:
    """An op's "auto" pick where it depends on the shape: with both GPU kernels usable, CUDA when
    ``prefer_cuda``, else Triton; otherwise ``default_backend``."""
    if "cuda" in usable and "triton" in usable:
        return "cuda" if prefer_cuda else "triton"
    return default_backend(usable)


def is_tracing() -> bool:
    """True under torch.compile / export or CUDA-graph capture, where host-side value checks
    (which synchronise) must be skipped; the kernels still never access out of bounds."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def tracing_or_dispatch_mode() -> bool:
    """Under tracing (``is_tracing``) or any Python dispatch mode (FakeTensorMode, make_fx,
    FlopCounterMode): tensors may hold no data, so the public ops skip their value checks (one host
    sync each; the kernels never access out of bounds either way) and call their Triton kernels
    through the registered custom ops (fake implementations; their own input checks) rather than
    the unchecked launchers they call in plain eager mode."""
    return is_tracing() or _get_current_dispatch_mode() is not None


def check_tensor(op: str, name: str, value, *, dtypes: Sequence[torch.dtype] | None = None,
                 ndim: int | Sequence[int] | None = None) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        names = ", ".join(dict.fromkeys(str(d).replace("torch.", "") for d in dtypes))  # (each once)
        raise ValueError(f"{op}: {name} must have dtype in ({names}), got {value.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            noun = "dimension" if allowed == (1,) else "dimensions"
            raise ValueError(f"{op}: {name} must have {' or '.join(map(str, allowed))} {noun}, "
                             f"got shape {tuple(value.shape)}")


def real_number(value) -> float | None:
    """value as a Python float when it is a real number (an int or a float, not a bool) that a
    float holds, else None: the checks of numeric arguments start here, and an int past float's
    range (which math.isfinite would meet with OverflowError) is refused like any other bad value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def check_contiguous(op: str, **tensors) -> None:
    """ValueError naming the first of ``tensors`` (None: skipped) that is not contiguous: for the
    Triton ops, whose kernels index these by their shapes alone."""
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous, got strides {t.stride()} for shape {list(t.shape)}")


def needs_grad(*tensors) -> bool:
    """Whether autograd records an op on these tensors (any of them requires a gradient)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_int(op: str, name: str, value, minimum: int) -> int:
    """An int (not a bool) >= minimum, else ValueError naming the argument; returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{op}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def check_same_device(op: str, **tensors) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{op}: {name} is on {device} but {first_name} is on {first}; "
                             "all tensors must be on one device")
    return first
