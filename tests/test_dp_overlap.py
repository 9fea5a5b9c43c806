"""DPOverlap: dp all-reduces start during backward (bucket by bucket, in order) and end equal to a
plain average of the replicas' gradients; disarmed (accumulating) backwards launch nothing."""

import copy

import dist as launch
import torch


def _worker(rank, world):
    import torch.distributed as dist
    from torch import nn

    from lightning_tp.dp_overlap import DPOverlap

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)  # each replica its own data (seeded by rank below), the same weights
        # the first layer is never used: in reverse order its bucket comes last, so the others can start
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                              nn.Linear(16, 4))
        ref = copy.deepcopy(model)  # the plain average, computed first
        torch.manual_seed(1 + rank)
        x = torch.randn(5, 8)
        ref[1:](x).sum().backward()
        ref[1:](x * 2).sum().backward()
        expected = {}
        for n, p in ref.named_parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                expected[n] = p.grad / world
        armed = {"on": False}
        overlap = DPOverlap(model.parameters(), None, world, armed=lambda: armed["on"], bucket_bytes=600)
        out = {"buckets": len(overlap.buckets),
               "first_unused": min(overlap.bucket_of[id(p)] for p in model[0].parameters())}

        model[1:](x).sum().backward()  # accumulating: nothing may start
        out["launched_disarmed"] = len(overlap.works)
        armed["on"] = True
        model[1:](x * 2).sum().backward()
        out["launched_in_backward"] = overlap.next  # buckets started before finish()
        overlap.finish()
        out["diffs"] = {n: (p.grad - expected[n]).abs().max().item() for n, p in model.named_parameters()
                        if p.grad is not None}
        out["unused_grad"] = model[0].weight.grad
        overlap.remove()
        return out
    finally:
        dist.destroy_process_group()


def test_overlapped_dp_all_reduce_starts_in_backward_and_averages():
    results = launch.run(2, _worker)
    for r in results:
        assert r["buckets"] >= 3
        assert r["launched_disarmed"] == 0
        # every bucket before the first holding the unused layer started before backward returned
        assert r["first_unused"] >= 2 and r["launched_in_backward"] == r["first_unused"]
        assert set(r["diffs"]) == {"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}
        assert max(r["diffs"].values()) < 1e-6, r["diffs"]
        assert r["unused_grad"] is None
