"""The runtime runs the TP collectives the cost model prices (2 gloo ranks, TP2).

One ``train_step`` of a zoo Llama (separate q/k/v and gate/up linears) is counted with
``profiler.step_collectives.CollectiveCounter`` at 2 and 3 layers: the increment is one layer's
collectives. Without sequence parallelism a layer all-reduces 4 times (Megatron's f and g: each
region's row output forward, each region's input gradient once backward, q/k/v and gate/up
summed locally first), not 7 (one per column module); with it, 4 all-gathers and 4
reduce-scatters. Both equal the priced count (``LayerCost.collective_counts``) of the same
model and plan, and the whole step's count equals the priced sum of its layers (with sequence
parallelism the first block's slice and the gather before the tail: ``workload.sequence_edges``;
under recompute a block's re-run forward collectives) plus the reported loss's all-reduce.
"""

from __future__ import annotations

import functools

import pytest
import torch

from nest_fx.apply import auto_parallelize
from nest_fx.apply.checks import ApplyError
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.cost.stage_terms import repeated_share
from nest_fx.cluster import Cluster
from nest_fx.graph import trace
from nest_fx.models import build_model
from nest_fx.models.build import build_seeded, model_example
from nest_fx.models.inputs import call_args, make_batch, with_loss_fn
from nest_fx.plan import uniform_plan
from nest_fx.testing import LOSSES, equivalence
from nest_fx.workload import analytical_workload, dims_from_config
from nest_fx.workload.build import trace_model
from nest_fx.workload.types import ModelDims
from profiler.step_collectives import CollectiveCounter

from tp_input_models import HIDDEN, MODELS, build_stack, mse_loss, stack_data
from tp_input_models import SEQ as SEQ_CUSTOM

LAUNCH_S = 300
TOL = 1e-5  # fp32 parity, as tests/distributed/apply/test_tp_layouts_dist.py
SEQ, VOCAB = 16, 128


def _spec(layers: int, family: str = "llama") -> str:
    if family == "moe":  # capacity_factor = experts / top_k: no token dropped
        return f"moe:hidden=64,layers={layers},heads=4,seq={SEQ},vocab={VOCAB},experts=4,top_k=2,capacity_factor=2.0"
    if family == "hf_mixtral":  # transformers 5: the experts' weights stacked in one module
        return f"hf:mixtral:hidden=64,layers={layers},heads=4,kv=2,seq={SEQ},vocab={VOCAB},experts=4,top_k=2"
    return f"llama:hidden=64,layers={layers},heads=4,seq={SEQ},vocab={VOCAB}"


def _counted(layer_counts, sequence_parallel: bool, recompute: str = "none", family: str = "llama"):
    """{layers: collectives of one train_step} on this rank (after a first, warm-up step)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    out = {}
    for layers in layer_counts:
        model, _ = build_model(_spec(layers, family))
        plan = uniform_plan(
            layers + 2,
            tp=2,
            microbatch_size=2,
            num_microbatches=1,
            sequence_parallel=sequence_parallel,
            recompute=recompute,
        )
        pm = auto_parallelize(model, tokens, global_batch_size=2, loss_fn=lm_loss, plan=plan, verbose=False)
        pm.train_step(tokens, tokens)
        with CollectiveCounter() as counter:
            pm.train_step(tokens, tokens)
        out[layers] = counter.counts
        out["calls", layers] = counter.calls
    return out


def _priced(layers: int, sequence_parallel: bool, family: str = "llama"):
    """({kind: count} of one block, {kind: count} summed over the chain, the block's cost) the cost
    model prices."""
    graph, cfg = trace_model(_spec(layers, family), seq=SEQ, dtype=torch.float32)
    work = analytical_workload(graph, dims_from_config(cfg, seq_len=SEQ), Cluster.preset("cpu-gloo", 2), torch.float32)
    costs = [work.cost(i, tp=2, microbatch_size=2, sequence_parallel=sequence_parallel) for i in range(len(work))]
    total = {}
    for cost in costs:
        for kind, n in cost.collective_counts().items():
            total[kind] = total.get(kind, 0) + n
    # the last block: under SP the first one also prices the slice after the head (sequence_edges)
    block = [i for i, layer in enumerate(work.layers) if layer.kind == "block"][-1]
    return costs[block].collective_counts(), total, costs[block]


def _priced_calls(layers: int, sp: bool):
    """{(kind, phase, bytes): count} of the TP collectives the cost model prices for one step."""
    graph, cfg = trace_model(_spec(layers), seq=SEQ, dtype=torch.float32)
    work = analytical_workload(graph, dims_from_config(cfg, seq_len=SEQ), Cluster.preset("cpu-gloo", 2), torch.float32)
    out: dict = {}
    for i in range(len(work)):
        for comm in work.cost(i, tp=2, microbatch_size=2, sequence_parallel=sp).comms:
            key = (comm.kind, comm.phase, comm.nbytes)
            out[key] = out.get(key, 0) + comm.count
    return out


def _priced_step(layers: int, sp: bool, recompute: str):
    """{kind: count} of one step as priced: every layer's TP collectives, a block's forward ones
    again where ``recompute`` re-runs them, and the reported loss's all-reduce."""
    graph, cfg = trace_model(_spec(layers), seq=SEQ, dtype=torch.float32)
    work = analytical_workload(graph, dims_from_config(cfg, seq_len=SEQ), Cluster.preset("cpu-gloo", 2), torch.float32)
    out = {"all_reduce": 1}
    for i in range(len(work)):
        cost = work.cost(i, tp=2, microbatch_size=2, sequence_parallel=sp)
        for comm in cost.comms:
            again = repeated_share(comm, recompute) if cost.block else 0.0
            out[comm.kind] = out.get(comm.kind, 0) + comm.count * (1 + again)
    return out


def _increment(counts):
    kinds = set(counts[2]) | set(counts[3])
    return {k: counts[3].get(k, 0) - counts[2].get(k, 0) for k in kinds if counts[3].get(k, 0) != counts[2].get(k, 0)}


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 60)
def test_tp_layer_collectives_are_the_priced_ones():
    for sp, per_layer in ((False, {"all_reduce": 4}), (True, {"all_gather": 4, "reduce_scatter": 4})):
        ranks = launch(_counted, 2, (2, 3), sp, timeout=LAUNCH_S)
        assert ranks[0] == ranks[1]
        counts = ranks[0]
        assert _increment(counts) == per_layer, (sp, counts)
        block, total, _ = _priced(3, sp)
        assert block == per_layer
        _, total2, _ = _priced(2, sp)
        assert {k: total[k] - total2.get(k, 0) for k in total if total[k] != total2.get(k, 0)} == per_layer
        # outside the price: the step's reported loss (one all-reduce over the world, not training);
        # under SP the gather before the tail and the slice's backward (an all-gather of the
        # embedding output's gradient) are priced (workload.sequence_edges)
        extra = {"all_reduce": 1}
        for layers in (2, 3):
            run, priced = counts[layers], _priced(layers, sp)[1]
            unpriced = {k: run.get(k, 0) - priced.get(k, 0) for k in set(run) | set(priced)}
            assert {k: n for k, n in unpriced.items() if n} == extra, (sp, layers, run, priced)
            # each call's phase and bytes too (the loss: one fp32 scalar)
            calls = {**_priced_calls(layers, sp), ("all_reduce", "fwd", 4): 1}
            assert counts["calls", layers] == calls, (sp, layers, counts["calls", layers], calls)


@pytest.mark.dist
@pytest.mark.timeout(2 * LAUNCH_S + 60)
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_recompute_reruns_the_priced_forward_collectives(sp):
    """Under full and op-level recompute a layer re-runs its forward TP collectives but the last
    one (its output feeds only the residual add: the checkpoint stops before it), as priced
    (``stage_terms.repeated_share``): without SP 5 all-reduces a layer (4 + 1), with SP 6
    all-gathers and 5 reduce-scatters under full, 6 and 4 under op (its reduce-scatters saved)."""
    block = _priced(3, sp)[2]
    counted = {}
    for recompute in ("full", "op"):
        steps = launch(_counted, 2, (2, 3), sp, recompute, timeout=LAUNCH_S)[0]
        counted[recompute] = _increment(steps)
        priced: dict = {}
        for comm in block.comms:
            if comm.group == "tp":
                priced[comm.kind] = priced.get(comm.kind, 0) + comm.count * (1 + repeated_share(comm, recompute))
        assert counted[recompute] == priced, (sp, recompute, counted, priced)
        for layers in (2, 3):  # the whole step: the slice and the gather (hooks outside the checkpoint) once
            whole = _priced_step(layers, sp, recompute)
            assert steps[layers] == whole, (sp, recompute, layers, steps[layers], whole)
    if sp:
        assert counted == {"full": {"all_gather": 6, "reduce_scatter": 5}, "op": {"all_gather": 6, "reduce_scatter": 4}}
    else:
        assert counted == {"full": {"all_reduce": 5}, "op": {"all_reduce": 5}}


@pytest.mark.dist
@pytest.mark.timeout(2 * LAUNCH_S + 60)
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
@pytest.mark.parametrize("family", ["moe", pytest.param("hf_mixtral", marks=pytest.mark.slow)])
def test_expert_tp_runs_the_priced_collectives(family, sp):
    """An MoE block under TP2 (``tp_collective_counts.expert_tp_collectives``). The zoo's 4 experts are a
    TP pair each: every expert all-reduces its output and each of its two columns' input
    gradients, 12 all-reduces a layer besides the attention's; HF Mixtral's stacked experts run
    on local shards: one all-reduce of the output, one of each floating input's gradient (the
    hidden states and the routing weights). Under SP the expert region gathers its input whole
    and slices its output (2 all-gathers, no reduce-scatter); under full recompute the forward
    all-reduces and the gather run again, but a last one nothing after saves (Mixtral's).
    Counted == priced."""
    if family.startswith("hf"):
        pytest.importorskip("transformers")  # the [hf] extra, installed by the README's commands
    block = _priced(3, sp, family)[2]
    for recompute in ("none", "full"):
        counted = _increment(launch(_counted, 2, (2, 3), sp, recompute, family, timeout=LAUNCH_S)[0])
        priced: dict = {}
        for comm in block.comms:
            if comm.group == "tp":
                priced[comm.kind] = priced.get(comm.kind, 0) + comm.count * (1 + repeated_share(comm, recompute))
        assert counted == priced, (sp, recompute, counted, priced)
        if recompute == "none" and family == "moe":
            assert counted == ({"all_gather": 4, "reduce_scatter": 2, "all_reduce": 12} if sp else {"all_reduce": 14})


def _custom_cells(cells):
    """Per (model of ``tp_input_models.MODELS``, sequence parallel): the parity run against one
    device and the collectives of one more train step (TP2), or the refusal before training."""
    out = {}
    for name, sp in cells:
        plan = {"tp": 2, "microbatch_size": 2, "num_microbatches": 1, "sequence_parallel": sp}
        spec = {
            "model": name,
            "plan": plan,
            "batch": 2,
            "seq": SEQ_CUSTOM,
            "steps": 2,
            "lr": 0.5,
            "build": functools.partial(build_stack, name),
            "data": stack_data,
            "loss": mse_loss,
        }
        try:
            parity = equivalence(spec)
        except ApplyError as refusal:
            out[name, sp] = str(refusal)
            continue
        model, _ = build_stack(name)
        x, y = stack_data(torch.Generator().manual_seed(0), 2)
        graph = trace(model, (x,))
        pm = auto_parallelize(
            model,
            x,
            global_batch_size=2,
            loss_fn=mse_loss,
            plan=uniform_plan(len(graph.blocks), **plan),
            graph=graph,
            verbose=False,
        )
        pm.train_step(x, y)
        with CollectiveCounter() as counter:
            pm.train_step(x, y)
        out[name, sp] = ({k: parity[k] for k in ("loss_diff", "grad_diff", "param_diff")}, counter.counts)
    return out


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 60)
def test_regions_prepared_once_or_per_column_run_what_is_priced_and_match_one_device():
    """With and without sequence parallelism: a region prepared once, keys and values reading a
    norm inside the region (their columns reduce alone), an MLP adding its own input, and BERT's
    post-norm attention whose columns' own module takes the input once (the last two run without
    SP; with it they are refused before training)."""
    cells = [(name, sp) for name in MODELS for sp in (False, True)]
    ranks = launch(_custom_cells, 2, cells, timeout=LAUNCH_S)
    for name, sp in cells:
        if sp and name in ("inner-residual", "post-norm"):  # a region adds its own input to its output
            assert all("sequence_parallel=false" in r[name, sp] for r in ranks), ranks[0][name, sp]
            continue
        model, _ = build_stack(name)
        graph = trace(model, (torch.randn(2, SEQ_CUSTOM, HIDDEN),))
        work = analytical_workload(graph, ModelDims(seq_len=SEQ_CUSTOM), Cluster.preset("cpu-gloo", 2), torch.float32)
        priced = {}
        for i in range(len(work)):
            for kind, n in work.cost(i, tp=2, microbatch_size=2, sequence_parallel=sp).collective_counts().items():
                priced[kind] = priced.get(kind, 0) + n
        priced["all_reduce"] = priced.get("all_reduce", 0) + 1  # the reported loss, over the world
        for diffs, counted in (r[name, sp] for r in ranks):
            assert all(v < TOL for v in diffs.values()), (name, sp, diffs)
            assert counted == priced, (name, sp, counted, priced)


def _hf_counted(names):
    """Per HF model type: the collectives of one train_step (TP2, after a warm-up step) and the
    sum the cost model prices over the chain for the same plan."""
    out = {}
    for name in names:
        model, cfg = build_seeded(name, 0)
        example = model_example(name, model, cfg, batch=2, seq=SEQ)
        if len(example.inputs) == 1:
            example = with_loss_fn(example)
        x, y = make_batch(example, "cpu", torch.Generator().manual_seed(0))
        args, kwargs = call_args(example, x)
        graph = trace(model, args, kwargs, name=name)
        plan = uniform_plan(len(graph.blocks), tp=2, microbatch_size=2, num_microbatches=1)
        pm = auto_parallelize(
            model,
            kwargs or (args[0] if len(args) == 1 else args),  # what train_step takes: one tensor or the dict
            global_batch_size=2,
            loss_fn=LOSSES.get(example.loss),
            plan=plan,
            graph=graph,
            verbose=False,
        )
        pm.train_step(x, y)
        with CollectiveCounter() as counter:
            pm.train_step(x, y)
        work = analytical_workload(graph, ModelDims(seq_len=SEQ), Cluster.preset("cpu-gloo", 2), torch.float32)
        priced = {}
        for i in range(len(work)):
            for kind, n in work.cost(i, tp=2, microbatch_size=2).collective_counts().items():
                priced[kind] = priced.get(kind, 0) + n
        out[name] = (counter.counts, priced)
    return out


@pytest.mark.hf
@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 60)
def test_hf_models_run_the_priced_tp_collectives():
    """BERT (post-norm attention: ``attention.self`` takes its input once; its MLM head tied to the
    embedding, with a bias of its own, stays replicated), BART (cross-attention: the keys and
    values read the encoder's output, each column reduces alone), GPT-2 (``Conv1D``, fused qkv):
    the step's collectives are the priced ones plus the reported loss's all-reduce."""
    pytest.importorskip("transformers")
    names = ["hf:bert", "hf:bart", "hf:gpt2"]
    for name, (counted, priced) in launch(_hf_counted, 2, names, timeout=LAUNCH_S)[0].items():
        priced["all_reduce"] += 1  # the reported loss, over the world
        assert counted == priced, (name, counted, priced)
