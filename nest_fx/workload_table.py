"""Read the ``nest-fx-workload/1`` layer table (see docs/workload_format.md)."""
from __future__ import annotations

from typing import Dict, List, Tuple

from nest_fx.workload import (RECOMPUTE_MODES, WORKLOAD_FORMAT, Comm, Layer, LayerCost, ModelDims, Workload,
                              WorkloadError)

_COST_FIELDS = ("fwd_s", "bwd_s", "num_params", "param_bytes", "act_bytes", "out_bytes")
_COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _number(value, where: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WorkloadError(f"{where}: expected a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise WorkloadError(f"{where}: must be {'> 0' if positive else '>= 0'}, got {value}")
    return float(value)


def _int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkloadError(f"{where}: expected a positive integer, got {value!r}")
    return value


class TableSource:
    """Costs looked up from a table keyed by (kind:signature, tp, ep, mbs, sp).

    A missing microbatch size is scaled linearly from the nearest smaller (else larger) one
    that is present: time, activation and boundary bytes scale with the microbatch, parameters
    do not.
    """

    def __init__(self, entries: Dict[Tuple[str, int, int, bool], Dict[int, LayerCost]]):
        self.entries = entries

    def cost(self, layer: Layer, tp: int, ep: int, mbs: int, sp: bool) -> LayerCost:
        key = (f"{layer.kind}:{layer.signature}", tp, ep, sp)
        by_mbs = self.entries.get(key) or (self.entries.get(key[:3] + (False,)) if sp else None)
        if not by_mbs:
            have = sorted({(t, e) for (k, t, e, _s) in self.entries if k == key[0]})
            raise WorkloadError(f"layer {layer.name!r} has no cost for tp={tp}, ep={ep}; the table has "
                                f"(tp, ep) in {have}")
        if mbs in by_mbs:
            return by_mbs[mbs]
        smaller = [b for b in by_mbs if b < mbs]
        base = max(smaller) if smaller else min(by_mbs)
        return _scaled(by_mbs[base], mbs / base)


def _scaled(c: LayerCost, f: float) -> LayerCost:
    return LayerCost(fwd_s=c.fwd_s * f, bwd_s=c.bwd_s * f, num_params=c.num_params, param_bytes=c.param_bytes,
                     act_bytes={k: v * f for k, v in c.act_bytes.items()},
                     recompute_s={k: v * f for k, v in c.recompute_s.items()}, out_bytes=c.out_bytes * f,
                     comms=[Comm(x.kind, x.group, x.nbytes * f, x.phase, x.count) for x in c.comms],
                     expert_params=c.expert_params)


def _parse_cost(v: dict, where: str) -> LayerCost:
    for name in _COST_FIELDS:
        if name not in v:
            raise WorkloadError(f"{where}.{name}: missing (each variant needs {', '.join(_COST_FIELDS)})")
    act = v["act_bytes"]
    if isinstance(act, (int, float)) and not isinstance(act, bool):
        act = {"none": act}
    if not isinstance(act, dict) or "none" not in act:
        raise WorkloadError(f"{where}.act_bytes: give a number or {{none, selective, full}} in bytes")
    acts = {m: _number(act.get(m, act["none"]), f"{where}.act_bytes.{m}") for m in RECOMPUTE_MODES}
    fwd = _number(v["fwd_s"], f"{where}.fwd_s")
    rec = v.get("recompute_s", {"none": 0.0, "selective": 0.0, "full": fwd})
    if not isinstance(rec, dict):
        raise WorkloadError(f"{where}.recompute_s: expected {{none, selective, full}} in seconds")
    recs = {m: _number(rec.get(m, 0.0 if m != "full" else fwd), f"{where}.recompute_s.{m}") for m in RECOMPUTE_MODES}
    comms = []
    for k, c in enumerate(v.get("comms", [])):
        cw = f"{where}.comms[{k}]"
        if not isinstance(c, dict) or c.get("kind") not in _COMM_KINDS:
            raise WorkloadError(f"{cw}.kind: use one of {_COMM_KINDS}")
        if c.get("group") not in ("tp", "ep"):
            raise WorkloadError(f"{cw}.group: use 'tp' or 'ep'")
        if c.get("phase") not in ("fwd", "bwd"):
            raise WorkloadError(f"{cw}.phase: use 'fwd' or 'bwd'")
        comms.append(Comm(c["kind"], c["group"], _number(c.get("nbytes"), f"{cw}.nbytes"), c["phase"],
                          _int(c.get("count", 1), f"{cw}.count")))
    return LayerCost(fwd_s=fwd, bwd_s=_number(v["bwd_s"], f"{where}.bwd_s"),
                     num_params=_number(v["num_params"], f"{where}.num_params"),
                     param_bytes=_number(v["param_bytes"], f"{where}.param_bytes"), act_bytes=acts,
                     recompute_s=recs, out_bytes=_number(v["out_bytes"], f"{where}.out_bytes"), comms=comms,
                     expert_params=_number(v.get("expert_params", 0.0), f"{where}.expert_params"))


def parse_table(data: dict, where: str = "workload") -> Workload:
    """Validate a layer table and build a Workload over a TableSource."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{where}: expected a JSON object")
    if data.get("format") != WORKLOAD_FORMAT:
        raise WorkloadError(f"{where}.format: expected {WORKLOAD_FORMAT!r}, got {data.get('format')!r}")
    dims_raw = data.get("dims")
    if not isinstance(dims_raw, dict) or "seq_len" not in dims_raw:
        raise WorkloadError(f"{where}.dims: needs at least seq_len (tokens per sequence)")
    allowed = set(ModelDims.__dataclass_fields__)
    bad = set(dims_raw) - allowed
    if bad:
        raise WorkloadError(f"{where}.dims: unknown field(s) {sorted(bad)}; known: {sorted(allowed)}")
    dims = ModelDims(**{k: int(_number(v, f"{where}.dims.{k}")) for k, v in dims_raw.items()})
    if dims.seq_len < 1:
        raise WorkloadError(f"{where}.dims.seq_len: must be >= 1")
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
            raise WorkloadError(f"{lw}.kind: use head, block or tail, got {kind!r}")
        sig = ly.get("signature")
        if not isinstance(sig, str) or not sig:
            raise WorkloadError(f"{lw}.signature: a non-empty string naming the layer's cost entry")
        layers.append(Layer(name=str(ly.get("name", f"layer{i}")), kind=kind, signature=sig,
                            num_params=_number(ly.get("num_params", 0), f"{lw}.num_params"),
                            flops_per_sample=_number(ly.get("flops_per_sample", 0), f"{lw}.flops_per_sample"),
                            is_moe=bool(ly.get("is_moe", False))))
    costs = data.get("costs")
    if not isinstance(costs, dict):
        raise WorkloadError(f"{where}.costs: expected an object mapping 'kind:signature' to variant lists")
    entries: Dict[Tuple[str, int, int, bool], Dict[int, LayerCost]] = {}
    for key, variants in costs.items():
        if not isinstance(variants, list) or not variants:
            raise WorkloadError(f"{where}.costs[{key!r}]: expected a non-empty list of variants")
        for k, v in enumerate(variants):
            vw = f"{where}.costs[{key!r}][{k}]"
            if not isinstance(v, dict):
                raise WorkloadError(f"{vw}: expected an object")
            tp, ep, mbs = (_int(v.get(n, 1), f"{vw}.{n}") for n in ("tp", "ep", "mbs"))
            entries.setdefault((key, tp, ep, bool(v.get("sp", False))), {})[mbs] = _parse_cost(v, vw)
    for i, ly in enumerate(layers):
        if not any(k[0] == f"{ly.kind}:{ly.signature}" for k in entries):
            raise WorkloadError(f"{where}.layers[{i}]: no costs entry {ly.kind}:{ly.signature!r}")
    return Workload(str(data.get("model", "workload")), layers, dims, TableSource(entries),
                    provenance=str(data.get("provenance", "table")))
