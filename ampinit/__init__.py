"""ampinit: automatic mixed precision for PyTorch with the NVIDIA Apex ``amp`` API."""

from ampinit._version import __version__

__all__ = ["__version__"]
