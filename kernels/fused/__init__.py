"""Fused-torch implementations of the kernels for CPU tensors: fast, portable, each with its
kernel's signature and semantics (the references in `reference/` stay the readable oracles)."""
