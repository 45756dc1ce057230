"""specdec-fast: fast, lossless speculative decoding for Hugging Face causal LMs."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("specdec-fast")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
