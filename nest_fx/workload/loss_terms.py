"""The loss on full logits as the runtime runs it (``plan.loss_kernel``): its FLOPs, the bytes it
moves, keeps for backward and holds during its backward (``TracedSource.cost``, the tail).

The loss is assumed to be a token-level cross entropy on the LM head's logits, computed in fp32
(``block_facts._loss_facts``: ``N`` logits of a microbatch, about 5 FLOPs each):

    loss_kernel    kept for backward          backward holds         bytes moved (forward)
    eager          4 N (fp32 log-probs)       2 x 4 N (fp32 grads)   logits + 8 N
    compile        logits + 8 per row         logits (their grad)    logits + 8 per row
    vocabulary-    4 N (fp32 softmax)         logits if narrower     logits + 8 N
    parallel                                  than fp32, else 0

Under loss parallelism (each rank's vocabulary shard) the runtime's vocabulary-parallel
cross-entropy (``apply/loss_parallel.py``) works in one fp32 buffer: the softmax it keeps becomes
the gradient in place, so its backward allocates only the cast of that gradient to the logits'
dtype (none for fp32 logits). Megatron-LM's vocabulary-parallel cross-entropy does the same. With
``loss_kernel=eager`` it computes the gradient in new tensors (two fp32 gradients, the eager row),
as PyTorch's DTensor ``loss_parallel`` (an op-by-op ``F.cross_entropy`` on sharded logits) does.
Counted on CPU by the new storages each pass allocates (``tests/unit/workload/test_loss_terms.py``).

Eager: ``F.cross_entropy(logits.float(), y)`` op by op; log-softmax keeps its fp32 output and
the backward holds the log-probabilities' and the logits' fp32 gradients at once. Compiled
(``torch.compile`` of the same function, inductor): one fused kernel each way; it keeps the
logits in their own dtype and two fp32 statistics per row (max and log-sum-exp), and its backward
writes only the logits' gradient. Measured on CPU (torch 2.13, inductor; saved tensors counted
once per storage): bf16 logits 2 bytes per logit + 8 per row kept, fp32 logits 4 + 8
(``tests/unit/workload/test_loss_terms.py``); a PyTorch compiler developer puts the compiled cross
entropy's memory at "~0 for just fwd and ~d_input for fw+bw" (Dao-AILab/quack issue #48). Both
keep the int64 targets, which neither row prices.
"""

from __future__ import annotations

from dataclasses import dataclass

from nest_fx.workload.block_facts import LOSS_BACKWARD_COPIES, BlockFacts

ROW_STATISTICS_BYTES = 8.0  # the compiled cross entropy's fp32 max and log-sum-exp per row


@dataclass(frozen=True)
class LossTerms:
    """One loss's figures for a share of a microbatch (all zero when the tail has no LM head)."""

    flops: float = 0.0
    bytes_moved: float = 0.0
    kept: float = 0.0
    backward_scratch: float = 0.0


def loss_terms(
    facts: BlockFacts, share: float, compiled: bool, byte_scale: float = 1.0, in_place: bool = False
) -> LossTerms:
    """The loss's terms for ``share`` of the traced batch (module docstring); ``compiled``: run by
    ``torch.compile`` (``loss_kernel=compile`` without loss parallelism); ``byte_scale``: the
    run's activation width over the trace's (the logits' dtype); ``in_place``: the
    vocabulary-parallel loss (loss parallelism)."""
    if not facts.loss_saved:
        return LossTerms()
    logits = (facts.loss_bytes_moved - 2 * facts.loss_saved) * byte_scale  # the logits in the run's dtype
    if not compiled:
        if in_place:
            scratch = logits if logits < facts.loss_saved else 0.0  # the gradient cast back to the logits' dtype
        else:
            scratch = LOSS_BACKWARD_COPIES * facts.loss_saved
        return LossTerms(
            facts.loss_flops * share,
            facts.loss_bytes_moved * share,
            facts.loss_saved * share,
            scratch * share,
        )
    kept = logits + ROW_STATISTICS_BYTES * facts.loss_tokens
    return LossTerms(facts.loss_flops * share, kept * share, kept * share, logits * share)
