"""Carnator engine: cross-request reuse for video diffusion transformers, in pure torch."""
__version__ = "0.1.0"
