"""Expert-parallel token dispatch against one process: dispatch, experts, combine."""

import torch
import torch.distributed as torch_dist

import dist
from lightning_tp.experts.dispatch import combine, dispatch

E, K, H = 4, 2, 6


def _experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(H, H, generator=g, dtype=torch.float64) for _ in range(E)]


def _tokens(rank, n=7):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    w = torch.rand(n, K, generator=g, dtype=torch.float64)
    return x, idx, w


def _moe(x, idx, w, weights, group, first):
    """Run the experts held here (global ids first..first+len(weights)-1) on the dispatched rows."""
    rows, per_expert, d = dispatch(x, idx, E, group)
    outs = [chunk @ weights[first + e] for e, chunk in enumerate(rows.split(per_expert))]
    y = torch.cat(outs) if outs else rows
    return combine(y, w, d, group)


def _reference(x, idx, w, weights):
    """Mixtral's loop: each expert on its tokens, weighted, summed per token."""
    out = torch.zeros_like(x)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        out.index_add_(0, tok, (x[tok] @ weights[e]) * w[tok, slot, None])
    return out


def test_one_process_matches_the_loop():
    x, idx, w = _tokens(0)
    x.requires_grad_(True)
    weights = _experts()
    y = _moe(x, idx, w, weights, None, 0)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = _reference(ref_x, idx, w, weights)
    assert torch.allclose(y, ref, atol=1e-12)
    y.square().sum().backward()
    ref.square().sum().backward()
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-12)


def _ep2(rank, world):
    torch_dist.init_process_group("gloo")
    group = torch_dist.new_group([0, 1])
    out = {}
    weights = _experts()
    local = E // world
    mine = weights[rank * local:(rank + 1) * local]
    # identity experts and weights 1/k: combine returns the input, and its gradient
    x, idx, _ = _tokens(rank)
    x.requires_grad_(True)
    rows, per_expert, d = dispatch(x, idx, E, group)
    y = combine(rows, torch.full((x.shape[0], K), 1.0 / K, dtype=x.dtype), d, group)
    g = torch.randn_like(x)
    y.backward(g)
    out["identity"] = (torch.allclose(y, x), torch.allclose(x.grad, g))
    # real experts: each rank's tokens as one process computes them with every expert
    x, idx, w = _tokens(rank)
    x.requires_grad_(True)
    y = _moe(x, idx, w, mine, group, 0)
    y.square().sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    ref = _reference(ref_x, idx, w, weights)
    ref.square().sum().backward()
    out["experts"] = ((y - ref).abs().max().item(), (x.grad - ref_x.grad).abs().max().item())
    # a rank that sends nothing to the other, and an expert that gets no token
    x, idx, w = _tokens(rank, n=3)
    idx = torch.full_like(idx, 0) if rank == 0 else torch.stack([torch.tensor([0, 1])] * 3)
    x.requires_grad_(True)
    y = _moe(x, idx, w, mine, group, 0)
    y.sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    ref = _reference(ref_x, idx, w, weights)
    ref.sum().backward()
    out["empty"] = ((y - ref).abs().max().item(), (x.grad - ref_x.grad).abs().max().item())
    return out


def test_two_ranks_match_one_process():
    for got in dist.run(2, _ep2, timeout=300):
        assert got["identity"] == (True, True)
        assert max(got["experts"]) < 1e-12, got
        assert max(got["empty"]) < 1e-12, got
