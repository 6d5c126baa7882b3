"""What the runtime can parallelise in one model: the one decision the planner and the runtime share.

:func:`parallel_support` inspects a model and its traced graph and answers, per parallelism and
degree, ``""`` (the runtime runs it and computes what the single-device model computes) or the
reason it cannot (naming the module). The planner searches only the degrees it allows
(``nest_fx.solver.runtime_planner``); the runtime's checks (``nest_fx.apply.checks``) refuse
the rest before any collective with the same reason. A plan is therefore never offered that the
runtime refuses, and never run when it would give a wrong number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from nest_fx.common.arith import divisors
from nest_fx.graph.moe_modules import expert_counts, unconvertible_experts
from nest_fx.graph.opgraph import OpGraph
from nest_fx.plan.plan import Plan
from nest_fx.workload.types import dims_from_config


def model_dims(model: nn.Module) -> Dict[str, Optional[int]]:
    """heads, kv_heads, ffn, experts, vocab of a zoo or HuggingFace model (None when unknown)."""
    d = dims_from_config(getattr(model, "config", None), seq_len=0)
    return {"heads": d.heads or None, "kv_heads": d.kv_heads or None, "ffn": d.ffn_hidden or None,
            "experts": d.num_experts or None, "vocab": d.vocab_size or None}


def _ancestors(path: str) -> List[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:k]) for k in range(len(parts) + 1)]


def head_tail_modules(model: nn.Module, graph) -> Tuple[List[str], List[str]]:
    """Top-most parameterised modules of the head and tail blocks (not above the layer container)."""
    container = graph.block_container
    above = set(_ancestors(container))
    modules = dict(model.named_modules())

    def tops(block) -> List[str]:
        found: List[str] = []
        for node in block.nodes:
            path = graph.graph.nodes[node].get("module", "")
            if not path:
                continue
            parts = path.split(".")
            for k in range(1, len(parts) + 1):
                prefix = ".".join(parts[:k])
                if prefix not in above:
                    if prefix in modules and prefix not in found and any(True for _ in modules[prefix].parameters()):
                        found.append(prefix)
                    break
        return found

    head = next((b for b in graph.blocks if b.kind == "head"), None)
    tail = next((b for b in graph.blocks if b.kind == "tail"), None)
    return (tops(head) if head else []), (tops(tail) if tail else [])


def batchnorm_modules(model: nn.Module) -> List[str]:
    """FQNs of the model's BatchNorm layers (their training statistics are those of the batch they see)."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


@dataclass
class ParallelSupport:
    """The runtime's verdict on one model, per parallelism and degree (see the module docstring).

    Each ``*_problem`` method returns ``""`` when the runtime runs that degree on this model and
    gives the single-device numbers, else one sentence naming the module and the reason.
    """

    model: nn.Module
    graph: Optional[OpGraph]
    _memo: Dict[Tuple[str, int], str] = field(default_factory=dict, repr=False)

    def _cached(self, kind: str, degree: int, compute) -> str:
        key = (kind, degree)
        if key not in self._memo:
            self._memo[key] = compute(degree)
        return self._memo[key]

    # -- tensor parallelism ---------------------------------------------------------------
    def tp_problem(self, tp: int) -> str:
        """Why ``tp`` cannot shard this model's blocks ("" when it can)."""
        return "" if tp == 1 else self._cached("tp", tp, self._tp_problem)

    def _tp_problem(self, tp: int) -> str:
        dims = model_dims(self.model)
        for key, what in (("heads", "attention heads"), ("kv_heads", "key/value heads"), ("ffn", "FFN hidden size")):
            n = dims.get(key)
            if n is not None and n % tp:
                return (f"tp={tp} does not divide the model's {n} {what} ({key}); tensor parallelism shards "
                        f"them evenly. fix: use tp in {[d for d in divisors(n) if d <= 64]}")
        if self.graph is None:
            return ""
        modules = dict(self.model.named_modules())
        for block in self.graph.blocks:
            pattern = self.graph.patterns.get(block.signature) if block.kind == "block" else None
            if pattern is None:
                continue
            for pair in pattern.tp_pairs:
                for rel, attr in [(c, "out_features") for c in pair.column] + [(pair.row, "in_features")]:
                    n = getattr(modules.get(f"{block.name}.{rel}"), attr, None)
                    if isinstance(n, int) and n % tp:
                        return (f"tp={tp} does not divide {block.name}.{rel}.{attr}={n}; fix: use tp in "
                                f"{[d for d in divisors(n) if d <= 64]}")
            break  # identical blocks share the pattern; one of each signature is enough
        return ""

    # -- pipeline parallelism -------------------------------------------------------------
    def pp_problem(self, pp: int) -> str:
        """Why the model cannot be split into ``pp`` pipeline stages ("" when it can)."""
        return "" if pp == 1 else (self.inputs_problem(pp) or self._cached("pp", pp, self._pp_problem))

    def inputs_problem(self, pp: int) -> str:
        """Why the model's traced inputs cannot enter a ``pp``-stage pipeline ("" when they can): the
        schedule feeds one tensor to the first stage."""
        names = getattr(self.graph, "input_names", None) or []
        if len(names) <= 1:
            return ""
        return (f"pp={pp}: {type(self.model).__name__} takes {len(names)} inputs ({', '.join(names)}) but a pipeline "
                "feeds one tensor to its first stage (labels for the model's own loss count as an input); fix: use "
                "pp=1, or pass one input and compute the loss with loss_fn on the last stage's output")

    def _pp_problem(self, pp: int) -> str:
        if self.graph is None:
            return ""
        head, tail = head_tail_modules(self.model, self.graph)
        head_params = {id(p) for h in head for p in self.model.get_submodule(h).parameters()}
        tied = sorted({t for t in tail for p in self.model.get_submodule(t).parameters() if id(p) in head_params})
        if tied:
            return (f"the model ties {tied} to its embedding, but with pp={pp} the head and the tail sit on "
                    "different pipeline stages; fix: untie the embeddings (e.g. tie_embeddings=False) or use pp=1")
        return ""

    # -- expert parallelism ---------------------------------------------------------------
    def num_experts(self) -> Optional[int]:
        """Experts per MoE layer that expert parallelism splits: counted on the model's MoE modules
        (zoo MoE lists, HF stacked experts), else the config's count, else None (a dense model)."""
        counts = expert_counts(self.model)
        if counts:
            return math.gcd(*counts)
        return model_dims(self.model)["experts"]

    def ep_problem(self, ep: int, dp: Optional[int] = None) -> str:
        """Why ``ep`` cannot split this model's experts ("" when it can); ``dp`` names the divisors
        that also divide the data-parallel degree in the fix."""
        if ep == 1:
            return ""
        experts = self.num_experts()
        if experts is None:
            return f"ep={ep} but the model has no experts (no MoE layer, no config.num_experts); fix: set ep=1"
        if experts % ep:
            fits = [d for d in divisors(experts) if dp is None or dp % d == 0]
            tail = f" (it must also divide dp={dp})" if dp is not None else ""
            return (f"ep={ep} does not divide the model's {experts} experts; each expert-parallel rank holds "
                    f"experts/ep of them. fix: use ep in {fits}{tail}")
        return self._cached("ep", ep, self._ep_layout_problem)

    def _ep_layout_problem(self, ep: int) -> str:
        other = unconvertible_experts(self.model)
        if other:
            return (f"ep={ep}: {type(self.model).__name__} keeps experts in {other[0]} in a layout expert "
                    "parallelism does not split (it converts the nest-fx zoo MoE and HuggingFace stacked experts, "
                    "whose parameters are [num_experts, ...] tensors). fix: use ep=1")
        if not expert_counts(self.model):
            return (f"ep={ep} but {type(self.model).__name__} has no MoE layer expert parallelism can convert (the "
                    "nest-fx zoo MoE or HuggingFace stacked experts). fix: use ep=1")
        return ""

    # -- microbatches ----------------------------------------------------------------------
    def microbatch_problem(self, microbatches: int) -> str:
        """Why a step of ``microbatches`` forwards per replica does not compute what one forward of the
        whole batch computes ("" when it does): BatchNorm statistics are per forward."""
        if microbatches <= 1:
            return ""
        norms = batchnorm_modules(self.model)
        if not norms:
            return ""
        shown = ", ".join(norms[:4]) + (f" and {len(norms) - 4} more" if len(norms) > 4 else "")
        return (f"BatchNorm layers ({shown}) normalise with the statistics of the batch one forward sees; with "
                f"{microbatches} microbatches per step each forward sees 1/{microbatches} of the batch, so the "
                "numbers differ from the single-device run. fix: one microbatch per step (microbatch_size = "
                "global_batch / dp, pp=1), or auto_parallelize(..., sync_batchnorm=False) to accept per-microbatch "
                "statistics (as DDP with gradient accumulation)")

    # -- context parallelism --------------------------------------------------------------
    def cp_problem(self, cp: int) -> str:
        """Why the model's sequence cannot be split over ``cp`` ranks ("" when it can)."""
        if cp == 1:
            return ""
        return f"cp={cp}: the runtime does not run context parallelism yet; fix: use cp=1"


def parallel_support(model: nn.Module, graph: Optional[OpGraph]) -> ParallelSupport:
    """The runtime's verdict on ``model`` (traced as ``graph``), for the planner and the runtime."""
    return ParallelSupport(model, graph)


def unimplemented_fields(plan: Plan) -> List[str]:
    """Plan fields the format holds but neither the cost model nor the runtime handles yet; both
    refuse a plan that uses them (never silently ignored)."""
    used = [name for name, on in (("cp", plan.cp > 1), ("dp_shard", plan.dp_shard not in (0, plan.dp)),
                                  ("loss_parallel", plan.loss_parallel), ("compile", plan.compile),
                                  ("float8", plan.float8)) if on]
    return used + [f"stages[{i}].recompute={s.recompute}" for i, s in enumerate(plan.stages)
                   if s.recompute not in ("none", "selective", "full")]
