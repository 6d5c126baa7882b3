"""Tracer and operator graph: ``trace(model, example_inputs) -> OpGraph``."""

from nest_fx.graph.capture import TraceError
from nest_fx.graph.opgraph import Block, BlockPattern, OpGraph, TPPair
from nest_fx.graph.tracer import trace

__all__ = ["trace", "OpGraph", "Block", "BlockPattern", "TPPair", "TraceError"]
