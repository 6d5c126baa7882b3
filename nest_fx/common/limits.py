"""Ranges for the numbers users give us (files and command-line options).

They lie far outside any real cluster, model or plan, and they keep every cost-model formula
finite: sums and products of a few counts and quantities stay below the float range, so the
simulator never meets ``inf - inf`` (NaN) or an ``int`` too large to convert to a float.
Readers refuse values outside them with an error naming the field and the limit.
"""
from __future__ import annotations

MAX_COUNT = 2**24
"""Largest count: devices, sequences per batch, sequence length, microbatches, parallel degrees,
layers, model dimensions (16,777,216)."""

MAX_QUANTITY = 1e30
"""Largest quantity in SI units: bytes, bytes/s, FLOP/s, FLOPs, parameters, seconds."""

MIN_RATE = 1.0
"""Smallest device memory (bytes), peak FLOP/s and bandwidth (bytes/s): rates are divided by."""

MAX_LAYERS = 1024
"""Most transformer layers a model spec may ask for (``gpt:...,layers=N``, ``hf:...,layers=N``): 8x the
deepest published LLMs (Llama 3 405B: 126) and above DeepNet's 1,000. Every layer is traced and
costed, about 20 ms each on a 2-core CPU (``nest-fx trace`` of 1,024 layers: docs/tracer.md), so a
typo such as ``layers=20000`` is refused at once instead of tracing for minutes without output."""
