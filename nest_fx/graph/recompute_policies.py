"""Recompute (activation checkpointing) policies: what each ``stages[i].recompute`` value keeps.

One definition for the runtime (``nest_fx.apply.activation_checkpoint`` applies them with
``torch.utils.checkpoint``) and for the cost model (which predicts the bytes they keep); the
profiler measures those bytes on CPU (``profiler.recompute_memory``). The plan's forms:

``none``        nothing recomputed: autograd keeps what every op saves for backward.
``full``        every block of the stage recomputed: only the block input is kept.
``every:<k>``   every k-th block of the stage fully recomputed, the others keep everything:
                blocks are counted 1, 2, ... through the stage in chain order (over all its
                chunks under the interleaved schedule) and block ``j`` (0-based) is recomputed
                when ``(j + 1) % k == 0``, so a stage of ``n`` blocks recomputes ``n // k`` of
                them (torchtitan's layer-frequency selective AC counts the same way).
``selective``   the attention core (Korthikanti et al. 2022): the attention kernels, softmax and
                batched matmuls, tensor factories and in-place ops are recomputed, every other
                op's output is saved (linears are never recomputed).
``op``          op-level selective checkpointing under :data:`OP_POLICIES` ``["default"]``.
``op:<name>``   op-level selective checkpointing under the named policy of :data:`OP_POLICIES`.

Op-level policies name aten op kinds (``mm``, ``_scaled_dot_product_flash_attention``, ...).
Under ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` the output of an op the
policy saves is kept (``MUST_SAVE``), everything else is recomputed in backward
(``PREFER_RECOMPUTE``). The ``default`` policy is torchtitan's ``op`` selective AC: save the
outputs of the attention kernels, of reduce-scatter, of ``max`` (the amax of low-precision
training), and of every other matmul: matmuls are counted 1, 2, 3, ... in each forward of a
block (separately in the recompute, so both passes decide alike) and the odd ones (1st, 3rd,
...) are saved. Two facts differ from torchtitan's list, written down here: nest-fx counts
``addmm`` as a matmul too (a linear with a bias; torchtitan's models have none, so its list names
``mm`` only), and the attention kernels include the CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``) so the policy means the same on CPU ranks.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch.utils.checkpoint import CheckpointPolicy

# aten op kinds (overload packet names) -------------------------------------------------------
ATTENTION_KERNELS: Tuple[str, ...] = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable",
)
MATMULS: Tuple[str, ...] = ("mm", "addmm")  # what a linear layer runs (without / with a bias)
REDUCE_SCATTERS: Tuple[str, ...] = ("_c10d_functional.reduce_scatter_tensor",)  # DTensor's reduce-scatter
AMAX: Tuple[str, ...] = ("max",)  # max(abs(x)) of Float8 scaling
# selective (attention core): recompute these, save everything else
ATTENTION_CORE: Tuple[str, ...] = ATTENTION_KERNELS + ("_softmax", "bmm", "baddbmm")
# Fresh buffers are free to recreate, and a saved one would break if the model fills it in place
# (the MoE router does ``new_zeros(...).scatter_(...)``): selective recomputes them too.
FACTORIES: Tuple[str, ...] = (
    "zeros",
    "zeros_like",
    "new_zeros",
    "new_empty",
    "new_full",
    "new_ones",
    "empty",
    "empty_like",
    "empty_strided",
    "full",
    "full_like",
    "ones",
    "ones_like",
    "arange",
    "scalar_tensor",
)


@dataclass(frozen=True)
class OpPolicy:
    """An op-level selective checkpointing policy: which aten op kinds keep their outputs.

    ``save``: op kinds whose outputs are always kept. ``matmul_period``: of the matmuls
    (:data:`MATMULS`) of one block forward, counted from 1, those with ``count % period == 1``
    are kept (period 1: every matmul, 2: every other one, starting with the first); 0 keeps none.
    Every other op is recomputed in backward.
    """

    name: str
    save: Tuple[str, ...]
    matmul_period: int
    summary: str

    def saves(self, kind: str, matmul_count: int = 0) -> bool:
        """Whether the output of an op of ``kind`` is kept; ``matmul_count`` is this op's 1-based
        position among the block's matmuls (ignored for other kinds)."""
        if kind in MATMULS:
            p = self.matmul_period
            return p > 0 and (matmul_count - 1) % p == 0
        return kind in self.save


OP_POLICIES: Dict[str, OpPolicy] = {
    p.name: p
    for p in (
        OpPolicy(
            "default",
            ATTENTION_KERNELS + REDUCE_SCATTERS + AMAX,
            2,
            "torchtitan's op SAC: attention outputs, reduce-scatters, amax and every other matmul kept",
        ),
        OpPolicy(
            "matmuls",
            ATTENTION_KERNELS + REDUCE_SCATTERS + AMAX,
            1,
            "every matmul and attention output kept; norms, activations and other elementwise ops recomputed",
        ),
        OpPolicy(
            "attention",
            ATTENTION_KERNELS + REDUCE_SCATTERS,
            0,
            "only attention outputs and reduce-scatters kept; matmuls recomputed too",
        ),
    )
}

_FORM = re.compile(r"^(none|selective|full|op|op:(?P<policy>[a-z0-9_-]+)|every:(?P<every>[0-9]+))$")


@dataclass(frozen=True)
class Recompute:
    """A parsed ``recompute`` value: ``kind`` in none | selective | full | op | every, the op
    policy for ``op``, the period for ``every``."""

    kind: str
    policy: Optional[OpPolicy] = None
    every: int = 0

    def recomputed_blocks(self, num_blocks: int) -> List[int]:
        """0-based indices of the stage's blocks that run under checkpoint."""
        if self.kind == "none":
            return []
        if self.kind == "every":
            return [j for j in range(num_blocks) if (j + 1) % self.every == 0]
        return list(range(num_blocks))


def recompute_policy_problem(value: str) -> str:
    """'' when the runtime knows the recompute value, else what is wrong and the known forms."""
    m = _FORM.match(value) if isinstance(value, str) else None
    known = ", ".join(f"op:{name}" for name in OP_POLICIES)
    if m is None:
        return (
            f"recompute={value!r} is not a recompute policy; use none, selective, full, op (= op:default), "
            f"{known} or every:<k> (k >= 2)"
        )
    if m.group("policy") and m.group("policy") not in OP_POLICIES:
        return f"recompute={value!r}: unknown op policy {m.group('policy')!r}; known: {known} (op = op:default)"
    if m.group("every") and int(m.group("every")) < 2:
        return f"recompute={value!r}: every:<k> needs k >= 2 (every:1 is full)"
    return ""


def parse_recompute(value: str) -> Recompute:
    """The :class:`Recompute` of a plan's ``recompute`` value; ValueError naming the known forms."""
    if isinstance(value, str):  # the cost model parses a few values thousands of times per search
        return _parse_known(value)
    return _parse(value)


@functools.lru_cache(maxsize=256)
def _parse_known(value: str) -> Recompute:
    return _parse(value)  # a Recompute is frozen: one object may serve every caller


def _parse(value: str) -> Recompute:
    problem = recompute_policy_problem(value)
    if problem:
        raise ValueError(problem)
    m = _FORM.match(value)
    if m.group("every"):
        return Recompute("every", every=int(m.group("every")))
    if value.startswith("op"):
        return Recompute("op", policy=OP_POLICIES[m.group("policy") or "default"])
    return Recompute(value)


# -- the policies as torch.utils.checkpoint policy functions --------------------------------


def aten_kind(op: torch._ops.OpOverload) -> str:
    """The kind of an aten op in these policies: its overload packet name of an aten op (``mm`` for
    ``aten.mm.default``), with its namespace for other namespaces (``_c10d_functional.reduce_scatter_tensor``)."""
    ns, _, rest = op.name().partition("::")
    packet = rest.split(".", 1)[0]
    return packet if ns == "aten" else f"{ns}.{packet}"


def _is_mutable(op) -> bool:
    return bool(getattr(getattr(op, "_schema", None), "is_mutable", False))


def selective_saves(kind: str, mutable: bool = False) -> bool:
    """Whether the ``selective`` policy keeps the output of an op of ``kind``: every op but the
    attention core, tensor factories and in-place ops (a saved tensor must not be mutated later)."""
    return not (kind in _SELECTIVE_RECOMPUTES or mutable)


_SELECTIVE_RECOMPUTES: FrozenSet[str] = frozenset(ATTENTION_CORE + FACTORIES)


def selective_policy_fn() -> Callable:
    """The ``selective`` policy for ``create_selective_checkpoint_contexts`` (:func:`selective_saves`)."""

    def policy(ctx, op, *args, **kwargs):
        if selective_saves(aten_kind(op), _is_mutable(op)):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_policy_fn(policy: OpPolicy) -> Callable:
    """``policy`` for ``create_selective_checkpoint_contexts``; call it once per checkpointed
    forward (the matmul counters start at 0 in each, separately for forward and recompute)."""
    counts = {False: 0, True: 0}  # ctx.is_recompute -> matmuls seen

    def decide(ctx, op, *args, **kwargs):
        kind = aten_kind(op)
        if kind in MATMULS:
            counts[ctx.is_recompute] += 1
        keep = policy.saves(kind, counts[ctx.is_recompute]) and not _is_mutable(op)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def kept_op_kinds(policy: OpPolicy, kinds: List[str]) -> List[bool]:
    """For the ops of one block forward in order (aten kinds), whether each output is kept under
    ``policy``: the counting the runtime does, for the cost model (:func:`saved_op_flags`)."""
    return saved_op_flags(Recompute("op", policy=policy), [(kind, False, ()) for kind in kinds])


# -- the policies on a recorded forward, for the cost model ---------------------------------

# One aten op of a block forward as the tracer records it (``nest_fx.graph.annotate``): its kind
# (``aten_kind``), whether it mutates an input, and the storages its outputs live in.
RecordedOp = Tuple[str, bool, Tuple[int, ...]]


def saved_op_flags(recompute: "Recompute", ops: Sequence[RecordedOp]) -> List[bool]:
    """For the ops of one block forward in order, whether a selective policy (``selective``,
    ``op``, ``op:<policy>``) keeps each one's outputs, with the matmuls counted as the runtime
    counts them (:func:`op_policy_fn`). The storages those outputs refer to stay alive (a saved
    view keeps its base); the cost model sums their bytes. ``none`` keeps what autograd saves and
    ``full`` only the block input: not op decisions."""
    if recompute.kind not in ("selective", "op"):
        raise ValueError(f"saved_op_flags: {recompute.kind!r} is not an op-level policy")
    flags: List[bool] = []
    count = 0
    for kind, mutable, _outputs in ops:
        if kind in MATMULS:
            count += 1
        if recompute.kind == "selective":
            flags.append(selective_saves(kind, mutable))
        else:
            flags.append(recompute.policy.saves(kind, count) and not mutable)
    return flags


def cost_key(value: str) -> str:
    """The key a layer's per-policy costs are stored under: the plan's form, with ``op:default``
    written ``op`` (the same policy)."""
    return "op" if value == "op:default" else value


# Policies costed per layer (the others, ``every:<k>``, mix ``none`` and ``full`` over a stage).
LAYER_POLICIES: Tuple[str, ...] = ("none", "selective", "full", "op") + tuple(
    f"op:{name}" for name in OP_POLICIES if name != "default"
)
