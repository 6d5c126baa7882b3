"""Expert parallelism's per-rank dispatch on stacked experts (2 gloo ranks): each token is sent
once to each rank owning one of its experts, and the layer computes the single-device result.

The module is HF-shaped (``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``,
experts stacked on dim 0) and written here, so the test needs no transformers. Each rank builds
the same module and routing from shared seeds, converts it with the runtime's own
``_convert_stacked`` and compares its output and gradients with the unconverted module's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nest_fx.apply.launch import launch
from nest_fx.workload.expert_dispatch import owner_ranks_per_token

E, H, F, K, T = 4, 6, 5, 2, 8
# the 8 tokens' expert pairs: experts 0-1 live on rank 0, 2-3 on rank 1 under ep=2; four tokens
# keep both choices on one rank (sent once), four straddle the ranks (sent to both)
ROUTES = [(0, 1), (2, 3), (0, 2), (3, 1), (1, 0), (2, 1), (3, 2), (0, 3)]
ROWS_PER_RANK_PAIR = 12  # distinct (token, owner rank) pairs over the 8 tokens: 4 x 1 + 4 x 2
# NeMo AutoModel's balanced benchmark gate: token t takes experts 2t, 2t + 1 mod 4 (``contiguous``)
BALANCED = [(2 * t % E, (2 * t + 1) % E) for t in range(T)]


class StackedExperts(nn.Module):
    """Experts stacked on dim 0, SwiGLU each, weighted and summed per token (as HF's)."""

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * F, H, generator=gen, dtype=torch.float64) / 3)
        self.down_proj = nn.Parameter(torch.randn(E, H, F, generator=gen, dtype=torch.float64) / 3)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, choice = torch.where(top_k_index == e)
            gate, up = nn.functional.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[e])
            out = out.index_add(0, token, y * top_k_weights[token, choice, None])
        return out


def _inputs(rank: int, routes):
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own tokens
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64)
    weights = torch.rand(T, K, generator=gen, dtype=torch.float64)
    index = torch.tensor(routes if rank == 0 else routes[::-1])
    return hidden, index, weights


def _worker():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nest_fx.apply import expert_parallel, init_distributed

    world, rank = init_distributed()
    mesh = init_device_mesh("cpu", (world,))
    reference, converted = StackedExperts(seed=1), StackedExperts(seed=1)
    expert_parallel._convert_stacked("experts", converted, world, rank, mesh)
    sent = {"routes": [], "balanced": []}  # rows of hidden states each all_to_all sends, per routing
    plain, routing = expert_parallel.all_to_all, ["routes"]

    def counting(x, group=None, send=None, recv=None):
        if x.is_floating_point() and x.dim() == 2 and x.shape[-1] == H:
            sent[routing[0]].append(x.shape[0])
        return plain(x, group, send, recv)

    expert_parallel.all_to_all = counting
    try:
        results = {}
        for name, module in (("reference", reference), ("converted", converted)):
            hidden, index, weights = _inputs(rank, ROUTES)
            hidden.requires_grad_(True)
            weights.requires_grad_(True)
            out = module(hidden, index, weights)
            probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=out.dtype)
            (out * probe).sum().backward()
            results[name] = (out.detach(), hidden.grad, weights.grad)
    finally:
        expert_parallel.all_to_all = plain
    # expert e's gradient: summed over the ranks' tokens (the converted rank holds it whole locally)
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    for grad in ref_grads.values():
        dist.all_reduce(grad)
    local = E // world
    diffs = {
        "out": float((results["converted"][0] - results["reference"][0]).abs().max()),
        "hidden_grad": float((results["converted"][1] - results["reference"][1]).abs().max()),
        "weight_grad": float((results["converted"][2] - results["reference"][2]).abs().max()),
    }
    for n, p in converted.named_parameters():
        expected = ref_grads[n][rank * local : (rank + 1) * local]
        diffs[f"{n}_grad"] = float((p.grad.to_local() - expected).abs().max())
    # the balanced gate's routing: every token's two experts on one rank, so it is sent once
    expert_parallel.all_to_all, routing[0] = counting, "balanced"
    try:
        converted(*_inputs(rank, BALANCED))
    finally:
        expert_parallel.all_to_all = plain
    return {"diffs": diffs, "sent_rows": sent["routes"], "balanced_rows": sent["balanced"]}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_per_rank_dispatch_sends_each_token_once_per_owner_and_matches_one_device():
    for result in launch(_worker, 2, timeout=90):
        assert max(result["diffs"].values()) < 1e-12, result["diffs"]
        # dispatch and combine: one row per (token, owner rank), not one per (token, choice)
        assert result["sent_rows"] == [ROWS_PER_RANK_PAIR, ROWS_PER_RANK_PAIR], result["sent_rows"]
        assert ROWS_PER_RANK_PAIR < T * K
        # the cost model's rows per token under the same routing (workload.expert_dispatch)
        expected = T * owner_ranks_per_token(E, K, 2, "contiguous")
        assert result["balanced_rows"][0] == expected == T, result["balanced_rows"]
