"""Every process group the strategy makes honours ``MegaStrategy(timeout=...)``, not torch's default
(gloo 30 min, NCCL 10 min): the device mesh's dims, the model-parallel, tied-embedding, expert, gloo twin
and async-checkpoint groups. On 2 gloo processes, read back from each group's backend options."""

from datetime import timedelta

import torch

import dist

TIMEOUT = timedelta(seconds=77)


def _timeout(group):
    return group._get_backend(torch.device("cpu")).options._timeout


def _groups_timeouts(rank, world):
    import torch.distributed as torch_dist

    from lightning_tp.mesh import build_mesh, gloo_twin_of_replica_group, use_tied_ranks

    torch_dist.init_process_group("gloo", timeout=TIMEOUT)
    out = {}
    pp = build_mesh(tp=1, pp=2, device_type="cpu", timeout=TIMEOUT)
    for name in ("tp", "dp", "pp"):
        out[f"mesh {name}"] = _timeout(pp.device_mesh.get_group(name))
    out["mp"], out["emb"], out["gloo twin"] = _timeout(pp.mp_group), _timeout(pp.emb_group), \
        _timeout(gloo_twin_of_replica_group(pp))
    use_tied_ranks(pp, (1, 0))
    out["emb (other ranks)"] = _timeout(pp.emb_group)
    ep = build_mesh(tp=1, pp=1, device_type="cpu", ep=2, timeout=TIMEOUT)
    out["ep"], out["edp"] = _timeout(ep.ep_group), _timeout(ep.edp_group)
    torch_dist.destroy_process_group()
    return out


def test_every_group_has_the_strategy_timeout():
    for got in dist.run(2, _groups_timeouts):
        assert got == {k: TIMEOUT for k in got}, got


def test_async_checkpoint_group_has_the_strategy_timeout(monkeypatch):
    import torch.distributed as torch_dist

    from lightning_tp import MegaStrategy
    from lightning_tp.checkpoints import files as checkpoint

    made = []
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch_dist, "new_group", lambda *a, **kw: made.append(kw.get("timeout")) or "group")
    monkeypatch.setattr(torch_dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(checkpoint.dcp_io, "save", lambda tensors, tmp, group=None: None)
    writer = MegaStrategy(async_save=True, timeout=77)._writer
    writer.start({}, lambda: None, None, lambda group: None)
    writer.wait()
    assert made == [TIMEOUT]
