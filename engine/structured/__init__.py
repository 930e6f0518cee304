"""Constrained decoding with xgrammar: what a request asks for (spec), the grammar it compiles to (grammar),
the engine's compile cache (compiler), and the per-sequence matchers and token bitmask (matcher)."""
from engine.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
