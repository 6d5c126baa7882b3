"""The coverage rule as a property: every plan the planner can offer a model runs at parity, and
every forced plan is parity or a refusal before the first collective.

* :func:`offered_plans`: the plans the runtime planner (``auto_parallelize``'s default) can offer a
  model on ``world`` devices: its plan for each TP x PP degree pair it may choose (the runtime's
  own verdicts, ``nest_fx.plan.may_run``, narrow the degrees; a pair the planner rules out is not
  offered), beside its free choice;
* :func:`run_cell`: one cell on ``world`` gloo ranks (:func:`nest_fx.testing.coverage_cell`), its
  outcome classified: ``ok`` / ``mismatch`` (numbers against one device), ``refused`` (a
  ``NestFxError`` before the ranks' first collective), ``crash`` (a failure once training started),
  ``late-refusal`` (a ``NestFxError`` after the first collective), ``error`` (any other exception
  while setting up, or a rank that died), ``timeout``.

``scripts/bench_coverage.py`` (the table) and ``tests/distributed/apply/test_coverage_rule.py`` (the property) use
both. Nothing in the package below the command line imports this module.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Optional

import torch.nn as nn

from nest_fx.apply.launch import launch
from nest_fx.apply.losses import token_cross_entropy_problem
from nest_fx.cluster import Cluster
from nest_fx.common.arith import divisors
from nest_fx.plan import Plan
from nest_fx.plan.constraints import ConstraintError, Constraints
from nest_fx.plan.support import model_dims
from nest_fx.solver import NoFeasiblePlan, SolverOptions
from nest_fx.solver.runtime_planner import planner_for, runtime_options
from nest_fx.testing import FAILURES, cell_status, coverage_cell

# launch failures of the machine, not of the cell: the rendezvous port taken between its probe and its
# bind, a gloo peer connection reset while the ranks connect
TRANSIENT = ("EADDRINUSE", "connectFullMesh failed")
_FAILURE = re.compile(r"CellFailure: (" + "|".join(FAILURES) + r") \(([^)]*)\): (.*)")
# outcomes that keep the rule: parity, or a refusal before the first collective
KEPT = ("ok", "refused")


def _planner(model: nn.Module, loss_fn: Optional[Callable], constraints: Optional[Constraints]):
    """The planner ``auto_parallelize`` builds when given no plan (loss parallelism only where the
    loss is token cross entropy, one microbatch per step for BatchNorm models)."""
    vocab = model_dims(model)["vocab"] or 8
    return planner_for(
        model, constraints=constraints, loss_parallel=loss_fn is None or not token_cross_entropy_problem(loss_fn, vocab)
    )


def offered_plans(
    model: nn.Module, graph, world: int, batch: int, loss_fn: Optional[Callable] = None, cluster=None
) -> Dict[str, Plan]:
    """Every plan the runtime planner can offer ``model`` (traced as ``graph``) on ``world`` devices
    of ``cluster`` (default: the ``cpu-gloo`` preset) for a global ``batch``: ``"planner"`` (its free
    choice) and ``"planner:tp<t>pp<p>"``, its plan with those degrees fixed, for each TP degree the
    runtime may run on the model and each pipeline depth, ``t * p`` dividing ``world``; a pair the
    planner finds no plan for (or refuses as a constraint) is not offered. ``loss_fn``: the one
    ``auto_parallelize`` gets (None: the model's own loss)."""
    cluster = cluster or Cluster.preset("cpu-gloo", world)
    options = runtime_options(model, graph, SolverOptions())
    max_pp = options.max_stages or world
    offered = {"planner": _planner(model, loss_fn, None)(graph, cluster, world, batch)}
    for tp in options.tp_degrees:
        for pp in divisors(world // tp) if world % tp == 0 else ():
            if pp > max_pp:
                continue
            try:
                plan = _planner(model, loss_fn, Constraints(fix={"tp": tp, "pp": pp}))(graph, cluster, world, batch)
            except (NoFeasiblePlan, ConstraintError):
                continue
            offered[f"planner:tp{tp}pp{pp}"] = plan
    return offered


def classify_failure(text: str) -> Dict[str, str]:
    """The outcome of a launch that raised (a rank's traceback text): the :class:`CellFailure`'s
    outcome and reason, else ``error`` with the last line of the first failing rank."""
    found = _FAILURE.search(text)
    if found:
        return {"status": found.group(1), "where": found.group(2), "reason": found.group(3).strip()[:400]}
    lines = [line for line in text.splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if not line.startswith("rank ")), lines[-1] if lines else "")
    return {"status": "error", "reason": last.strip()[:400]}


def run_cell(spec: Dict[str, Any], world: int, timeout: float) -> Dict[str, Any]:
    """One coverage cell (:func:`nest_fx.testing.coverage_cell` on ``world`` ranks): its outcome
    (``status`` and, for a refusal or failure, ``reason``; for a run, the differences and the
    plan). A launch that lost the rendezvous race to another job is launched once more."""
    for attempt in range(2):
        try:
            return cell_status(launch(coverage_cell, world, spec, timeout=timeout))
        except TimeoutError as exc:
            return {"status": "timeout", "reason": str(exc).splitlines()[0]}
        except RuntimeError as exc:  # a rank failed: its CellFailure, or its last traceback line
            if attempt == 0 and any(t in str(exc) for t in TRANSIENT):
                continue
            return classify_failure(str(exc))
    raise AssertionError("unreachable")
