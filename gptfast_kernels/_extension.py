"""Loads the compiled extension and says which backends are usable.

Importing gptfast_kernels never fails because of the extension: without it (not built, or built
without CUDA) the affected backends are simply unavailable and the "reference" path remains.
"""

from __future__ import annotations

import importlib.util
import os

import torch

NAMESPACE = "gptfast_kernels"
_OPS_WITH_KERNELS = ("int8_linear", "int8_expert_linear", "kv_cache_attention", "verify_draft")

try:
    from gptfast_kernels import _C  # noqa: F401  (registers torch.ops.gptfast_kernels.*)

    EXTENSION_ERROR: str | None = None
except ImportError as exc:  # not built: CPU/CUDA backends unavailable, reference still works
    EXTENSION_ERROR = str(exc)


def extension_loaded() -> bool:
    return EXTENSION_ERROR is None


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether torch.ops.gptfast_kernels.<op> has a compiled kernel for CPU or CUDA."""
    if not extension_loaded():
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", dispatch_key)
    except RuntimeError:  # op not registered in this build
        return False


def ops_without_kernel(dispatch_key: str) -> list[str]:
    """The ops that have no compiled kernel for ``dispatch_key`` ("CPU" or "CUDA") in this build."""
    return [op for op in _OPS_WITH_KERNELS if not has_kernel(op, dispatch_key)]


def cuda_compiled() -> bool:
    """Whether the extension was built with its CUDA kernels (a GPU need not be present)."""
    return any(has_kernel(op, "CUDA") for op in _OPS_WITH_KERNELS)


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_FOUND


def usable_backends(device: torch.device) -> list[str]:
    """The backends that can run on tensors of this device, in no particular order."""
    return list(_USABLE.get((device.type, triton_interpreting()), ("reference",)))


def _usable_backends(device_type: str, interpreting: bool) -> tuple[str, ...]:
    backends = ["reference"]
    if device_type == "cpu":
        if extension_loaded():
            backends.append("cpu")
        if triton_available() and interpreting:
            backends.append("triton")
    elif device_type == "cuda":
        if cuda_compiled():
            backends.append("cuda")
        if triton_available() and not interpreting:
            backends.append("triton")
    return tuple(backends)


# Asked on every op call, and the answer never changes in a process: computed once, here, for every
# key (other device types: the reference only). (Filled lazily instead, a torch.compile'd first call
# that came before any eager op call would trace the insertion and guard on the key's absence, so
# its second call would compile again.)
_USABLE: dict[tuple[str, bool], tuple[str, ...]] = {
    (device_type, interpreting): _usable_backends(device_type, interpreting)
    for device_type in ("cpu", "cuda") for interpreting in (False, True)}
