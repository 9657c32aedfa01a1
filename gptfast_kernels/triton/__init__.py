"""Triton kernels, one module per op. Importing this package requires Triton; the op wrappers in
gptfast_kernels.ops import it lazily so the package works without Triton."""
