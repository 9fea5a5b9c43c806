"""DPOverlap: dp all-reduces start during backward (bucket by bucket, in order) and end equal to a
plain average of the replicas' gradients; disarmed (accumulating) backwards launch nothing."""

import copy

import dist as launch
import torch


def _worker(rank, world):
    import torch.distributed as dist
    from torch import nn

    from lightning_tp.dp.overlap import DPOverlap

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


def _fake_launches(monkeypatch):
    """DPOverlap without processes: a launch records its grads, settle 'averages' by halving them."""
    from lightning_tp.dp import overlap as D

    launched = []

    def start(grads, group):
        launched.append([g.clone() for g in grads])
        return None, None, grads

    def settle(works, scale):
        for _, _, grads in works:
            for g in grads:
                g.mul_(scale)

    monkeypatch.setattr(D, "start_all_reduce", start)
    monkeypatch.setattr(D, "settle", settle)
    return launched


def test_a_hook_firing_twice_counts_once_and_a_raised_step_starts_over(monkeypatch):
    from torch import nn

    from lightning_tp.dp.overlap import DPOverlap

    launched = _fake_launches(monkeypatch)
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    overlap = DPOverlap([a, b], None, 2, armed=lambda: True, bucket_bytes=10**6, hooked=False)
    assert len(overlap.buckets) == 1
    overlap.hook()
    (a * 3).sum().backward()
    (a * 3).sum().backward()  # a twice, b not yet: the bucket is not complete
    assert launched == [] and overlap.next == 0
    overlap.remove()
    overlap.restart()  # a pipelined step starts so: one that raised left a count behind
    overlap.hook()
    (b * 2).sum().backward()
    assert launched == []
    (a * 1).sum().backward()
    assert len(launched) == 1
    overlap.remove()


def test_pipeline_merge_adds_a_kept_gradient_after_a_started_all_reduce(monkeypatch):
    from torch import nn

    from lightning_tp.dp.overlap import DPOverlap
    from lightning_tp.pipeline.run.executor import PipelineRunner

    _fake_launches(monkeypatch)
    module = nn.Linear(2, 1, bias=False)
    p = module.weight
    overlap = DPOverlap([p], None, 2, armed=lambda: True, hooked=False)
    overlap.hook()
    module(torch.ones(1, 2)).sum().backward()  # the step's final backward: the bucket starts
    overlap.remove()
    fresh, p.grad = p.grad, torch.full((1, 2), 10.0)  # what the step left, and a .grad not zeroed
    p._pp_fresh_grad = fresh
    PipelineRunner.merge_grads(module, overlap)
    assert p.grad is fresh and torch.equal(p.grad, torch.ones(1, 2))  # the kept 10 waits for the sync
    overlap.finish()
    assert torch.equal(p.grad, torch.full((1, 2), 10.5))  # average (fake: half) of 1, plus 10
    # without a started all-reduce the kept gradient is added at once
    p._pp_fresh_grad, p.grad = torch.ones(1, 2), torch.full((1, 2), 10.0)
    PipelineRunner.merge_grads(module, None)
    assert torch.equal(p.grad, torch.full((1, 2), 11.0))


def test_sync_reduces_parameters_the_overlap_does_not_know(monkeypatch):
    from types import SimpleNamespace

    from torch import nn

    from lightning_tp.dp import grads as G

    reduced = []
    monkeypatch.setattr(G, "_reduce", lambda grads, group, scale=1.0: reduced.append((len(grads), group)))
    monkeypatch.setattr(G, "average_over_dp", lambda params, group, scale: reduced.append((len(params), group)))
    known, later = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))  # later: unfrozen after setup
    known.grad, later.grad = torch.ones(2), torch.ones(2)
    overlap = SimpleNamespace(finish=lambda: None, bucket_of={id(known): 0})
    mesh = SimpleNamespace(world_size=2, emb_group=None, pp_rank=0, pp=1, tp_group=None, etp_group=None, dp_group="dp",
                           dp=2, replicas=2, tp_rank=0)
    G.sync_gradients([known, later], mesh, overlap)
    assert (1, "dp") in reduced  # the unfrozen parameter is averaged over dp too
