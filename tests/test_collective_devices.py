"""Every collective the strategy issues runs on its root device, also on a rank with nothing to send (a
frozen pipeline stage, zero slices without gradients): NCCL rejects CPU tensors. On CPU the test makes
``meta`` the root device and fails on any tensor elsewhere."""

import types

import pytest
import torch
import torch.distributed as dist

from lightning_tp import comm
from lightning_tp.mesh import ParallelMesh
from lightning_tp.strategy import MegaStrategy
from lightning_tp.dp.sync import GradSync
from lightning_tp.dp.zero.optimizer import ShardedOptimizer

ROOT = torch.device("meta")


@pytest.fixture
def collectives_on_root(monkeypatch):
    """Pretends every group has two ranks; each collective asserts its tensor is on ``ROOT``."""
    seen = []

    def all_reduce(t, op=None, group=None, async_op=False):
        assert t.device == ROOT, f"all_reduce of a {t.device} tensor; the root device is {ROOT}"
        seen.append(t.device)

    monkeypatch.setattr(comm, "group_size", lambda group: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return seen


def _zero_without_grads(param):
    """A zero=1 optimizer whose only (dense) slice got no gradient on this rank."""
    sl = types.SimpleNamespace(param=param, counted=1.0)
    bucket = types.SimpleNamespace(expert=False, slices=[sl], group="dp")
    return types.SimpleNamespace(buckets=[bucket], norm_parts=None)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("zero", [False, True])
def test_clipping_on_a_rank_without_gradients_reduces_on_the_root_device(collectives_on_root, norm_type, zero):
    frozen = torch.nn.Parameter(torch.ones(3, device=ROOT), requires_grad=False)  # a frozen first stage
    sharded = None
    if zero:
        sharded = _zero_without_grads(torch.nn.Parameter(torch.ones(3, device=ROOT)))
        sharded.norm_parts = types.MethodType(ShardedOptimizer.norm_parts, sharded)
    optimizer = types.SimpleNamespace(param_groups=[{"params": [frozen]}], _lightning_tp_zero=sharded)
    sync = GradSync(None, ParallelMesh(tp=1, pp=2, dp=1, rank=0, mp_group="mp"), lambda: True)
    strategy = types.SimpleNamespace(_grads=sync, root_device=ROOT)  # the strategy hands its root device over
    MegaStrategy._clip_grad_by_norm(strategy, optimizer, 1.0)
    assert len(collectives_on_root) == (2 if zero else 1)
