"""Patching Hugging Face models: the family table, the attention hooks and ``patch_model``."""

from gptfast_kernels.models.families import FAMILIES, family_of
from gptfast_kernels.models.patch import is_patched, patch_model

__all__ = ["FAMILIES", "family_of", "is_patched", "patch_model"]
