"""Autoregressive generation on a mesh: ``Generator``, ``generate``, ``Sampling``."""

from spmd.generation.generator import GenerationResult, Generator, generate
from spmd.generation.sampling import Sampling

__all__ = ["GenerationResult", "Generator", "Sampling", "generate"]
