"""Whole-width q/k norms under tensor parallelism (OLMo2's ``q_norm = RMSNorm(heads * head_dim)``
on the whole projected query, before the heads are viewed): the tracer finds them
(``graph.tp_wide_norms``), the runtime shards their weights like the projection and all-reduces
their statistic (``apply.tp_wide_norm``), the cost model prices that all-reduce, and the parallel
runs equal the single-device runs on 4 gloo ranks."""

from __future__ import annotations

from types import SimpleNamespace

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from nest_fx.apply.launch import launch
from nest_fx.apply.tp_wide_norm import WholeWidthNorm
from nest_fx.graph.opgraph import TPParam
from nest_fx.graph import trace
from nest_fx.models import build_seeded
from nest_fx.plan.may_run import may_run
from nest_fx.testing import equivalence

TOL = 1e-5
LAUNCH_S = 300
OLMO2_GQA = "hf:olmo2:num_key_value_heads=2"  # 4 query heads, 2 key/value heads of 16 features


class NormedAttention(nn.Module):
    """Attention whose query and key are normalised over the whole projection by torch's own norm
    modules (``nn.LayerNorm``: mean and variance; ``nn.RMSNorm``: ``F.rms_norm``)."""

    def __init__(self, dim: int, heads: int, functional: bool = False, affine: bool = True):
        super().__init__()
        self.heads, self.functional = heads, functional
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.q_norm, self.k_norm = nn.LayerNorm(dim, elementwise_affine=affine), nn.RMSNorm(dim)

    def forward(self, x):
        b, t, _ = x.shape
        if self.functional:  # a norm of the attention's own forward: not a module tensor parallelism can wrap
            q = F.rms_norm(self.q(x), (x.shape[-1],))
        else:
            q = self.q_norm(self.q(x))
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, self.k_norm(self.k(x)), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class NormedBlock(nn.Module):
    def __init__(self, dim: int, heads: int, functional: bool, affine: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = NormedAttention(dim, heads, functional, affine)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class NormedLM(nn.Module):
    def __init__(
        self,
        vocab: int = 128,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        functional: bool = False,
        affine: bool = True,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(NormedBlock(dim, heads, functional, affine) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_normed(seed: int = 0, functional: bool = False, affine: bool = True):
    """A picklable ``build(seed)`` for ``equivalence``: non-trivial norm weights and biases
    (``affine=False``: a query norm without them)."""
    torch.manual_seed(seed)
    model = NormedLM(functional=functional, affine=affine)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_norm." in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    return model, SimpleNamespace(vocab_size=128, seq_len=16)


class TorchLayerNorm(nn.Module):
    """``torch.layer_norm`` called directly, over the width of its input."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return torch.layer_norm(x, x.shape[-1:], self.weight, self.bias, 1e-5)


class MeanRMSNorm(nn.Module):
    """A hand-written RMSNorm (HF's, with the mean taken without keepdim)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = torch.mean(x.float().pow(2), dim=-1)
        return self.weight * (x * torch.rsqrt(variance + 1e-6).unsqueeze(-1))


NORMS = {
    "nn.LayerNorm": lambda: nn.LayerNorm(64),
    "nn.RMSNorm": lambda: nn.RMSNorm(64),
    "nn.RMSNorm without weight": lambda: nn.RMSNorm(64, elementwise_affine=False),
    "torch.layer_norm": lambda: TorchLayerNorm(64),
    "hand-written mean": lambda: MeanRMSNorm(64),
}


def _norm_parity(_):
    """On each of 2 ranks: every norm of NORMS on the rank's 32 of 64 features (WholeWidthNorm)
    against the whole norm on one device; the largest difference of output, input gradient and
    parameter gradients per norm, and the collectives one forward and backward issued."""
    dist.init_process_group("gloo")
    mesh, rank = init_device_mesh("cpu", (2,)), dist.get_rank()
    own = slice(32 * rank, 32 * rank + 32)
    out = {}
    for name, make in NORMS.items():
        torch.manual_seed(0)
        whole = make()
        with torch.no_grad():
            for p in whole.parameters():
                p.normal_(1.0, 0.5)
        x = torch.randn(2, 8, 64, requires_grad=True)
        probe = torch.randn(2, 8, 64)
        (whole(x) * probe).sum().backward()
        local = parallelize_module(
            copy.deepcopy(whole), mesh, WholeWidthNorm({n: TPParam(name=n, dim=0) for n, _ in whole.named_parameters()})
        )
        xl = x.detach()[..., own].clone().requires_grad_()
        y = local(xl)
        (y * probe[..., own]).sum().backward()
        diffs = [(y - whole(x)[..., own]).abs().max(), (xl.grad - x.grad[..., own]).abs().max()]
        diffs += [
            (p.grad.to_local() - whole.get_parameter(n).grad[own]).abs().max() for n, p in local.named_parameters()
        ]
        out[name] = float(max(diffs))
    return out


def test_whole_width_norm_computes_the_whole_norm_on_each_ranks_features():
    """nn.LayerNorm and nn.RMSNorm (F.layer_norm, F.rms_norm), torch.layer_norm and a hand-written
    mean of squares, on 2 gloo ranks each holding half the features: outputs and gradients equal
    the whole norm's to fp32 rounding."""
    results = launch(_norm_parity, 2, None, timeout=120)
    for name in NORMS:
        worst = max(r[name] for r in results)
        print(f"{name}: {worst:.1e}")
        assert worst < 1e-5, (name, worst)


def _traced(name_or_build):
    model, cfg = build_seeded(name_or_build) if isinstance(name_or_build, str) else name_or_build()
    return model, trace(model, (torch.randint(0, cfg.vocab_size, (2, 8)),))


@pytest.mark.hf
def test_olmo2_q_and_k_norms_are_sharded_with_their_projections():
    pytest.importorskip("transformers")
    model, graph = _traced(OLMO2_GQA)
    attn = next(p for p in graph.pattern_of(graph.layer_blocks[0]).tp_pairs if p.kind == "attention")
    assert attn.column == ["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"] and not attn.problem
    assert attn.wide_norms == ["self_attn.k_norm", "self_attn.q_norm"]
    dims = {p.name: p.dim for p in attn.params}
    assert dims["self_attn.q_norm.weight"] == 0 and dims["self_attn.k_norm.weight"] == 0  # like the columns
    check = may_run(model, graph)
    assert check.degree_problem("tp", 2) == ""
    # 2 key/value heads: tp=4 would split a head of the key projection, and of its norm's features
    assert "does not divide the model's 2 key/value heads" in check.degree_problem("tp", 4)


def test_torch_norm_modules_over_the_whole_projection_are_sharded():
    """nn.LayerNorm (two statistics) and nn.RMSNorm as the query and key norms: found as whole-width
    norms, their weights and bias sharded; TP runs (tp_rehearsal included)."""
    model, graph = _traced(build_normed)
    attn = next(p for p in graph.pattern_of(graph.layer_blocks[0]).tp_pairs if p.kind == "attention")
    assert attn.wide_norms == ["attn.k_norm", "attn.q_norm"] and not attn.problem
    assert {"attn.q_norm.weight", "attn.q_norm.bias", "attn.k_norm.weight"} <= {p.name for p in attn.params}
    assert may_run(model, graph).degree_problem("tp", 2) == ""
    # without a weight to shard, the norm's own normalized_shape is localised all the same
    model, graph = _traced(functools.partial(build_normed, affine=False))
    attn = next(p for p in graph.pattern_of(graph.layer_blocks[0]).tp_pairs if p.kind == "attention")
    assert attn.wide_norms == ["attn.k_norm", "attn.q_norm"] and "attn.q_norm.weight" not in {
        p.name for p in attn.params
    }
    assert may_run(model, graph).degree_problem("tp", 2) == ""


def test_a_norm_in_the_attentions_own_forward_is_refused_naming_it():
    """F.rms_norm over the whole query inside the attention's forward: no module of its own for the
    runtime to run with gathered statistics, so TP is refused before training, saying where and why."""
    model, graph = _traced(lambda: build_normed(functional=True))
    problem = may_run(model, graph).degree_problem("tp", 2)
    assert "takes its query through 'layers.0.attn', a norm over all the heads' 64 features" in problem, problem
    assert problem.endswith("fix: use tp=1 for this model"), problem


@pytest.mark.hf
def test_the_cost_model_prices_the_statistic_all_reduces():
    """Per layer and direction under TP: one all-reduce of one fp32 value per token for each
    whole-width norm (OLMo2: q_norm and k_norm), beside the row linears' all-reduces; none at tp=1,
    none for per-head norms (Qwen3)."""
    pytest.importorskip("transformers")
    from nest_fx.cluster import load_cluster
    from nest_fx.workload import workload_for_model

    cluster = load_cluster("dgx-a100:8")
    olmo, qwen = (workload_for_model(name, cluster) for name in ("hf:olmo2", "hf:qwen3"))
    tokens = olmo.cost(1, tp=2).comms[0].nbytes / (64 * 2)  # the row's output: tokens x hidden 64 in bf16
    for sp in (False, True):
        stats = [c for c in olmo.cost(1, tp=2, sp=sp).comms if c.kind == "all_reduce" and c.nbytes == tokens * 4]
        assert sorted((c.phase, c.count) for c in stats) == [("bwd", 1), ("bwd", 1), ("fwd", 1), ("fwd", 1)]
    assert not olmo.cost(1, tp=1).comms
    assert not [c for c in qwen.cost(1, tp=2).comms if c.nbytes == tokens * 4]
    # priced: the TP layer costs more communication than the same layer without the norms' statistics
    assert (
        sum(c.nbytes * c.count for c in olmo.cost(1, tp=2).comms)
        == sum(c.nbytes * c.count for c in qwen.cost(1, tp=2).comms) + 4 * tokens * 4
    )


def _many(specs):
    return [equivalence(spec) for spec in specs]


def _spec(model: str, plan: dict, **extra) -> dict:
    return {"model": model, "plan": plan, "batch": 8, "seq": 16, "steps": 3, "lr": 0.5, **extra}


def _check(specs, world: int = 4):
    results = launch(_many, world, specs, timeout=LAUNCH_S)
    out = []
    for i, spec in enumerate(specs):
        ranks = [r[i] for r in results]
        worst = {k: max(r[k] for r in ranks) for k in ("loss_diff", "grad_diff", "param_diff")}
        print(f"\n{spec['model']} {spec['plan']}: " + ", ".join(f"{k}={v:.1e}" for k, v in worst.items()))
        assert all(v < TOL for v in worst.values()), (spec["model"], spec["plan"], worst)
        assert all(r["num_grads"] > 0 for r in ranks)
        out.append(ranks)
    return out


TP2_DP2 = {"tp": 2, "dp": 2, "microbatch_size": 4}


@pytest.mark.hf
@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 60)
def test_tp2_dp2_with_whole_width_norms_equals_one_device():
    """OLMo2 with grouped key/values (its own RMSNorm: a mean of squares) and torch's LayerNorm and
    RMSNorm as query/key norms, TP2 x DP2 on 4 gloo ranks: losses, gradients and parameters of 3
    SGD steps equal the single-device run's; the norms' weights are sharded."""
    pytest.importorskip("transformers")
    olmo, normed = _check([_spec(OLMO2_GQA, TP2_DP2), _spec("normed", TP2_DP2, build=build_normed)])
    assert "model.layers.1.self_attn.q_norm.weight" in olmo[0]["sharded"]
    assert "model.layers.1.self_attn.k_norm.weight" in olmo[0]["sharded"]
    assert "layers.1.attn.q_norm.bias" in normed[0]["sharded"]


@pytest.mark.hf
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
def test_sequence_parallel_moe_and_zero3_with_whole_width_norms():
    pytest.importorskip("transformers")
    sp = dict(TP2_DP2, sequence_parallel=True)
    _check(
        [
            _spec("hf:olmo2", sp),
            _spec("hf:olmoe", TP2_DP2),
            _spec("normed", sp, build=build_normed),
            _spec("normed, no q_norm weight", TP2_DP2, build=functools.partial(build_normed, affine=False)),
            _spec(OLMO2_GQA, dict(TP2_DP2, zero=3, recompute="full")),
        ]
    )


@pytest.mark.hf
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
def test_compiled_blocks_with_whole_width_norms(monkeypatch):
    """torch.compile (aot_eager: dynamo and AOT autograd without inductor's C++ build) over blocks
    whose norms gather their statistic inside a torch-function mode."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("NEST_FX_COMPILE_BACKEND", "aot_eager")
    _check([_spec(OLMO2_GQA, {"tp": 2, "compile": True, "microbatch_size": 8, "sequence_parallel": True})], world=2)
