"""The workload's file form, ``nest-fx-workload/1`` (see docs/workload_format.md): write a
workload's distinct layer costs as a table, read a table back as a workload."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, replace
from typing import Dict, List, Sequence, Tuple

from nest_fx.common.fileio import brief, read_json
from nest_fx.common.limits import MAX_COUNT, MAX_QUANTITY
from nest_fx.common.names import close_matches
from nest_fx.graph.recompute_policies import LAYER_POLICIES
from nest_fx.workload.expert_dispatch import EXPERT_ROUTINGS
from nest_fx.workload.types import (
    COMM_GROUPS,
    RECOMPUTE_MODES,
    WORKLOAD_FORMAT,
    Comm,
    Layer,
    LayerCost,
    ModelDims,
    Variant,
    Workload,
    WorkloadError,
)

_COST_FIELDS = ("fwd_s", "bwd_s", "num_params", "param_bytes", "act_bytes", "out_bytes")
_OPTIONAL_BYTES = ("expert_params", "bwd_scratch", "fp8_params", "tied_params")  # numbers, default 0
_COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _number(value, where: str) -> float:
    """``value`` as a float when it is a finite number >= 0 (SI units), else WorkloadError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WorkloadError(f"{where}: expected a number, got {brief(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise WorkloadError(f"{where}: must be a finite number, got {brief(value)}")
    if number < 0:
        raise WorkloadError(f"{where}: must be >= 0, got {brief(value)}")
    if number > MAX_QUANTITY:
        raise WorkloadError(f"{where}: must be at most {MAX_QUANTITY:g} (SI units), got {brief(value)}")
    return number


def _int(value, where: str, least: int = 1) -> int:
    """``value`` when it is an integer (not a bool) in [``least``, MAX_COUNT], else WorkloadError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise WorkloadError(f"{where}: expected {kind}, got {brief(value)}")
    if value > MAX_COUNT:
        raise WorkloadError(f"{where}: {brief(value)} is larger than nest-fx handles (at most {MAX_COUNT:,})")
    return value


def _bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise WorkloadError(f"{where}: expected true or false, got {brief(value)}")
    return value


class TableSource:
    """Costs looked up from a table keyed by (kind:signature, tp, ep, sp, cp, lp).

    A missing microbatch size is scaled linearly from the nearest smaller (else larger) one
    that is present: time, activation and boundary bytes scale with the microbatch, parameters
    do not. A sequence-parallel variant falls back to the plain one; context parallelism and loss
    parallelism are costed only where the table lists them (``cp``, ``lp`` in a variant).
    """

    def __init__(self, entries: Dict[Tuple[str, int, int, bool, int, bool], Dict[int, LayerCost]]):
        self.entries = entries

    def _by_mbs(self, layer: Layer, tp: int, ep: int, sp: bool, cp: int, lp: bool) -> Dict[int, LayerCost]:
        """The layer's entries for the variant by microbatch size. Empty when the table lacks it."""
        key = (f"{layer.kind}:{layer.signature}", tp, ep, sp, cp, lp)
        plain = (key[0], tp, ep, False, cp, lp)
        return self.entries.get(key) or (self.entries.get(plain) if sp else None) or {}

    def missing(self, layer: Layer, tp: int, ep: int, sp: bool, cp: int = 1, lp: bool = False) -> str:
        """'' when :meth:`cost` can answer for this layer and variant (any microbatch size), else
        what the table lacks and what it has."""
        if self._by_mbs(layer, tp, ep, sp, cp, lp):
            return ""
        mine = [k for k in self.entries if k[0] == f"{layer.kind}:{layer.signature}"]
        if cp > 1 or lp:
            have = sorted({(t, e, c, bool(p)) for (_k, t, e, _s, c, p) in mine})
            return (
                f"layer {layer.name!r} has no cost for tp={tp}, ep={ep}, cp={cp}, lp={str(lp).lower()}; the table "
                f"has (tp, ep, cp, lp) in {have}"
            )
        have = sorted({(t, e) for (_k, t, e, _s, _c, _p) in mine})
        return f"layer {layer.name!r} has no cost for tp={tp}, ep={ep}; the table has (tp, ep) in {have}"

    def cost(self, layer: Layer, tp: int, ep: int, mbs: int, sp: bool, cp: int = 1, lp: bool = False) -> LayerCost:
        by_mbs = self._by_mbs(layer, tp, ep, sp, cp, lp)
        if not by_mbs:
            raise WorkloadError(self.missing(layer, tp, ep, sp, cp, lp))
        if mbs in by_mbs:
            return by_mbs[mbs]
        smaller = [b for b in by_mbs if b < mbs]
        base = max(smaller) if smaller else min(by_mbs)
        return _scaled(by_mbs[base], mbs / base)


def _scaled(c: LayerCost, f: float) -> LayerCost:
    return LayerCost(
        fwd_s=c.fwd_s * f,
        bwd_s=c.bwd_s * f,
        num_params=c.num_params,
        param_bytes=c.param_bytes,
        act_bytes={k: v * f for k, v in c.act_bytes.items()},
        recompute_s={k: v * f for k, v in c.recompute_s.items()},
        out_bytes=c.out_bytes * f,
        comms=[
            replace(x, nbytes=x.nbytes * f, dispatched=tuple((d, r, b * f) for d, r, b in x.dispatched))
            for x in c.comms
        ],
        expert_params=c.expert_params,
        bwd_scratch=c.bwd_scratch * f,
        fp8_params=c.fp8_params,
        tied_params=c.tied_params,
    )


def _parse_cost(v: dict, where: str) -> LayerCost:
    for name in _COST_FIELDS:
        if name not in v:
            raise WorkloadError(f"{where}.{name}: missing (each variant needs {', '.join(_COST_FIELDS)})")
    act = v["act_bytes"]
    if isinstance(act, (int, float)) and not isinstance(act, bool):
        act = {"none": act}
    if not isinstance(act, dict) or "none" not in act:
        raise WorkloadError(f"{where}.act_bytes: give a number or {{none, selective, full, op, ...}} in bytes")
    fwd = _number(v["fwd_s"], f"{where}.fwd_s")
    rec = v.get("recompute_s", {"none": 0.0, "selective": 0.0, "full": fwd})
    if not isinstance(rec, dict):
        raise WorkloadError(f"{where}.recompute_s: expected {{none, selective, full, op, ...}} in seconds")
    for name, given in (("act_bytes", act), ("recompute_s", rec)):
        unknown = set(given) - set(LAYER_POLICIES)
        if unknown:
            raise WorkloadError(
                f"{where}.{name}: unknown recompute polic{'ies' if len(unknown) > 1 else 'y'} "
                f"{sorted(unknown, key=str)}; known: {list(LAYER_POLICIES)}"
            )
    # the three classic modes default (selective and full to what is kept without them); an op
    # policy is costed only where the table gives its bytes
    policies = list(RECOMPUTE_MODES) + [m for m in LAYER_POLICIES if m not in RECOMPUTE_MODES and m in act]
    acts = {m: _number(act.get(m, act["none"]), f"{where}.act_bytes.{m}") for m in policies}
    recs = {m: _number(rec.get(m, 0.0 if m != "full" else fwd), f"{where}.recompute_s.{m}") for m in policies}
    comms = []
    if not isinstance(v.get("comms", []), list):
        raise WorkloadError(f"{where}.comms: expected a list of collectives, got {brief(v['comms'])}")
    for k, c in enumerate(v.get("comms", [])):
        cw = f"{where}.comms[{k}]"
        if isinstance(c, dict) and isinstance(c.get("unrecomputed"), int) and c["unrecomputed"] > c.get("count", 1):
            raise WorkloadError(f"{cw}.unrecomputed: at most its count ({c.get('count', 1)})")
        if not isinstance(c, dict) or c.get("kind") not in _COMM_KINDS:
            raise WorkloadError(f"{cw}.kind: use one of {_COMM_KINDS}")
        if c.get("group") not in COMM_GROUPS:
            raise WorkloadError(f"{cw}.group: use one of {COMM_GROUPS}")
        if c.get("phase") not in ("fwd", "bwd"):
            raise WorkloadError(f"{cw}.phase: use 'fwd' or 'bwd'")
        dispatched = c.get("dispatched", [])
        if not isinstance(dispatched, list) or any(
            not isinstance(e, (list, tuple)) or len(e) != 3 or e[1] not in EXPERT_ROUTINGS for e in dispatched
        ):
            raise WorkloadError(
                f"{cw}.dispatched: a list of [dispatch, routing, bytes] entries, routing one of {EXPERT_ROUTINGS}"
            )
        comms.append(
            Comm(
                c["kind"],
                c["group"],
                _number(c.get("nbytes"), f"{cw}.nbytes"),
                c["phase"],
                _int(c.get("count", 1), f"{cw}.count"),
                _int(c.get("unrecomputed", 0), f"{cw}.unrecomputed", least=0),
                tuple((str(d), r, _number(b, f"{cw}.dispatched.{d}.{r}")) for d, r, b in dispatched),
            )
        )
    num_params = _number(v["num_params"], f"{where}.num_params")
    extra = {name: _number(v.get(name, 0.0), f"{where}.{name}") for name in _OPTIONAL_BYTES}
    for name in ("expert_params", "fp8_params"):
        if extra[name] > num_params:
            raise WorkloadError(
                f"{where}.{name}: {extra[name]:g} exceeds num_params={num_params:g} "
                f"(they are part of the layer's parameters)"
            )
    return LayerCost(
        fwd_s=fwd,
        bwd_s=_number(v["bwd_s"], f"{where}.bwd_s"),
        num_params=num_params,
        param_bytes=_number(v["param_bytes"], f"{where}.param_bytes"),
        act_bytes=acts,
        recompute_s=recs,
        out_bytes=_number(v["out_bytes"], f"{where}.out_bytes"),
        comms=comms,
        **extra,
    )


def workload_from_table(data: dict, where: str = "workload") -> Workload:
    """Validate a layer table and build a Workload over a TableSource."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{where}: expected a JSON object")
    if data.get("format") != WORKLOAD_FORMAT:
        raise WorkloadError(f"{where}.format: expected {WORKLOAD_FORMAT!r}, got {brief(data.get('format'))}")
    dims_raw = data.get("dims")
    if not isinstance(dims_raw, dict) or "seq_len" not in dims_raw:
        raise WorkloadError(f"{where}.dims: needs at least seq_len (tokens per sequence)")
    allowed = set(ModelDims.__dataclass_fields__)
    bad = set(dims_raw) - allowed
    if bad:
        raise WorkloadError(
            f"{where}.dims: unknown field(s) {sorted(bad, key=str)}"
            f"{close_matches(sorted(bad, key=str)[0], allowed)}; known: {sorted(allowed)}"
        )
    dims = ModelDims(
        **{k: _int(v, f"{where}.dims.{k}", 1 if k in ("seq_len", "dtype_bytes") else 0) for k, v in dims_raw.items()}
    )
    raw_layers = data.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise WorkloadError(f"{where}.layers: expected a non-empty list of layers")
    layers: List[Layer] = []
    for i, ly in enumerate(raw_layers):
        lw = f"{where}.layers[{i}]"
        if not isinstance(ly, dict):
            raise WorkloadError(f"{lw}: expected an object")
        kind = ly.get("kind", "block")
        if kind not in ("head", "block", "tail"):
            raise WorkloadError(f"{lw}.kind: use head, block or tail, got {brief(kind)}")
        sig = ly.get("signature")
        if not isinstance(sig, str) or not sig:
            raise WorkloadError(f"{lw}.signature: a non-empty string naming the layer's cost entry")
        name = ly.get("name", f"layer{i}")
        if not isinstance(name, str) or not name:
            raise WorkloadError(f"{lw}.name: expected a non-empty string, got {brief(name)}")
        layers.append(
            Layer(
                name=name,
                kind=kind,
                signature=sig,
                num_params=_number(ly.get("num_params", 0), f"{lw}.num_params"),
                flops_per_sample=_number(ly.get("flops_per_sample", 0), f"{lw}.flops_per_sample"),
                is_moe=_bool(ly.get("is_moe", False), f"{lw}.is_moe"),
            )
        )
    costs = data.get("costs")
    if not isinstance(costs, dict):
        raise WorkloadError(f"{where}.costs: expected an object mapping 'kind:signature' to variant lists")
    entries: Dict[Tuple[str, int, int, bool, int, bool], Dict[int, LayerCost]] = {}
    for key, variants in costs.items():
        if not isinstance(variants, list) or not variants:
            raise WorkloadError(f"{where}.costs[{key!r}]: expected a non-empty list of variants")
        for k, v in enumerate(variants):
            vw = f"{where}.costs[{key!r}][{k}]"
            if not isinstance(v, dict):
                raise WorkloadError(f"{vw}: expected an object")
            tp, ep, mbs, cp = (_int(v.get(n, 1), f"{vw}.{n}") for n in ("tp", "ep", "mbs", "cp"))
            sp, lp = (_bool(v.get(n, False), f"{vw}.{n}") for n in ("sp", "lp"))
            entries.setdefault((key, tp, ep, sp, cp, lp), {})[mbs] = _parse_cost(v, vw)
    for i, ly in enumerate(layers):
        if not any(k[0] == f"{ly.kind}:{ly.signature}" for k in entries):
            raise WorkloadError(f"{where}.layers[{i}]: no costs entry {ly.kind}:{ly.signature!r}")
    model, provenance = data.get("model", "workload"), data.get("provenance", "table")
    for name, value in (("model", model), ("provenance", provenance)):
        if not isinstance(value, str):
            raise WorkloadError(f"{where}.{name}: expected a string, got {brief(value)}")
    return Workload(model, layers, dims, TableSource(entries), provenance=provenance)


def workload_to_table(
    workload: Workload,
    tps: Sequence[int] = (1, 2, 4, 8),
    eps: Sequence[int] = (1,),
    mbss: Sequence[int] = (1,),
    sps: Sequence[bool] = (False,),
    cps: Sequence[int] = (1,),
    lps: Sequence[bool] = (False,),
) -> dict:
    """Tabulate the variants of each distinct layer into the JSON layer-table format (``cp`` and
    ``lp`` are written where they are not 1 / false, so older readers see the tables they knew)."""
    signatures = {}
    for i in workload.distinct():
        layer = workload.layers[i]
        variants = []
        for tp in tps:
            if not workload.dims.tp_ok(tp):
                continue
            for ep in eps if layer.is_moe else (1,):
                if not workload.dims.ep_ok(ep):
                    continue
                for mbs, sp, cp, lp in itertools.product(mbss, sps, cps, lps if layer.kind == "tail" else (False,)):
                    if workload.variant_problem(Variant(tp, ep, sequence_parallel=sp, cp=cp, loss_parallel=lp)):
                        continue
                    cost = workload.own_cost(i, Variant(tp, ep, mbs, sp, cp, lp)).to_dict()  # no edges: Workload.cost
                    extra = {**({"cp": cp} if cp > 1 else {}), **({"lp": True} if lp else {})}
                    variants.append(dict(tp=tp, ep=ep, mbs=mbs, sp=sp, **extra, **cost))
        signatures[f"{layer.kind}:{layer.signature}"] = variants
    return {
        "format": WORKLOAD_FORMAT,
        "model": workload.model,
        "provenance": workload.provenance,
        "dims": asdict(workload.dims),
        "layers": [asdict(layer) for layer in workload.layers],
        "costs": signatures,
    }


def save_workload(workload: Workload, path: str, **table_kwargs) -> None:
    """Write :func:`workload_to_table` as JSON to ``path`` (``table_kwargs``: the variants)."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(workload_to_table(workload, **table_kwargs), fh, indent=1)


def load_workload(path: str) -> Workload:
    """Read and validate a ``nest-fx-workload/1`` file (WorkloadError naming the field)."""
    return workload_from_table(read_json(path, WorkloadError, "workload"), where=path)
