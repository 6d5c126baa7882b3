"""The autograd all_to_all of expert parallelism: forward and backward against a reference.

Rank r sends chunk i of its input to rank i. The reference builds every rank's input from a
shared seed, so each rank can compute the expected output (chunk r of every rank's input) and,
for a loss sum(out * w_r), the expected input gradient (the w of the receiving rank, chunk
by chunk) without communication.
"""

from __future__ import annotations

import pytest
import torch

from nest_fx.apply.expert_parallel import all_to_all
from nest_fx.apply.launch import launch

WORLD = 4


def _inputs(rank: int, world: int):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(world * 2, 3, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(world * 2, 3, 5, generator=gen, dtype=torch.float64)
    return x, w


def _worker():
    import torch.distributed as dist

    from nest_fx.apply import init_distributed

    world, rank = init_distributed()
    x, w = _inputs(rank, world)
    x.requires_grad_(True)
    out = all_to_all(x)
    (out * w).sum().backward()
    # expected forward: chunk j of my output is chunk `rank` of rank j's input
    expect = torch.cat([_inputs(j, world)[0].chunk(world)[rank] for j in range(world)])
    # expected backward: chunk j of my input went to rank j, where it was multiplied by chunk
    # `rank` of rank j's weight
    expect_grad = torch.cat([_inputs(j, world)[1].chunk(world)[rank] for j in range(world)])
    # through a group that is not the world: ranks {0, 2} and {1, 3}
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    sub = groups[rank % 2]
    y = torch.arange(4.0).reshape(2, 2) + 10 * rank
    got_sub = all_to_all(y, sub)
    peer = (rank + 2) % 4
    mine_first = rank < peer
    rows = (
        [y[0], (torch.arange(4.0).reshape(2, 2) + 10 * peer)[0]]
        if mine_first
        else [(torch.arange(4.0).reshape(2, 2) + 10 * peer)[1], y[1]]
    )
    # uneven splits (HF experts): rank r sends count(r, i) rows to rank i; a row holds its route
    count = lambda src, dst: (src + dst) % 3 + 1  # noqa: E731

    def rows_from(src, dst):
        return torch.tensor([[100.0 * src + 10 * dst + k] for k in range(count(src, dst))], dtype=torch.float64)

    v = torch.cat([rows_from(rank, i) for i in range(world)]).requires_grad_(True)
    got_v = all_to_all(v, None, [count(rank, i) for i in range(world)], [count(j, rank) for j in range(world)])
    (got_v * got_v.detach()).sum().backward()  # the gradient of a row is its value, sent back to its sender
    return {
        "fwd": float((out.detach() - expect).abs().max()),
        "bwd": float((x.grad - expect_grad).abs().max()),
        "sub": float((got_sub - torch.stack(rows)).abs().max()),
        "uneven": float((got_v.detach() - torch.cat([rows_from(j, rank) for j in range(world)])).abs().max()),
        "uneven_bwd": float((v.grad - v.detach()).abs().max()),
    }


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_all_to_all_forward_backward():
    results = launch(_worker, WORLD, timeout=60)
    for r in results:
        assert r["fwd"] == r["bwd"] == r["sub"] == r["uneven"] == r["uneven_bwd"] == 0.0, r


def test_all_to_all_gradcheck_single_rank():
    """One rank: the exchange is the identity, and gradcheck passes through the autograd function."""
    import torch.distributed as dist

    from nest_fx.apply.expert_parallel import _AllToAll

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        assert torch.equal(all_to_all(x), x)
        assert torch.autograd.gradcheck(lambda t: _AllToAll.apply(None, t), (x,))
    finally:
        if created:
            dist.destroy_process_group()


def test_all_to_all_rejects_uneven_split(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    with pytest.raises(ValueError, match="divisible by the group size 3"):
        all_to_all(torch.zeros(4, 2), group=object())
