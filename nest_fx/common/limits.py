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

MAX_LAYERS = 512
"""Most transformer layers a model spec may ask for (``gpt:...,layers=N``, ``hf:...:layers=N``): 4x the
deepest published LLMs (Llama 3 405B: 126). Every layer is traced and costed: ``nest-fx trace`` of a
small GPT took 3.3 s for 100 layers and 8.3 s for 400 on the 2-core CPU box (90 s for 512 and 200 s
for 1,024 with the box at a load average of 20), so a typo such as ``layers=20000`` is refused at once instead of tracing for
minutes without output (docs/tracer.md)."""
