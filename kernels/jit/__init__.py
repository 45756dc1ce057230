"""Only `@triton.jit` functions live here; launchers and validation live in `kernels/<op>.py`."""
