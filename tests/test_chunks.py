"""Where a rank's local tensor (or a ZeRO slice of it) lies in the full one: every chunk holds exactly the
full tensor's values at its offsets, for each kind of ShardSpec, and all but the padding is covered."""

import pytest
import torch

from lightning_tp.checkpoints.chunks import chunks_of, flat_chunks_of
from lightning_tp.layers.shard import ShardSpec, shard

W = 2
SPECS = {
    "qkv_sections": ((12, 4), ShardSpec(dim=0, world=W, full=12, chunks=3)),
    "padded_vocab": ((7, 4), ShardSpec(dim=0, world=W, full=7, padded=8)),
    "copied_kv_heads": ((4, 8), ShardSpec(dim=0, world=W, full=4, sections=(2, 1, 1), replicas=(1, W, W))),
    # a key/value head of several rows copied to both ranks: each rank's copy starts at the head's first row
    "copied_kv_heads_rows": ((8, 3), ShardSpec(dim=0, world=W, full=8, sections=(4, 2, 2), replicas=(1, W, W))),
    "rows": ((5, 6), ShardSpec(dim=1, world=W, full=6)),
    "last_dim_chunks": ((3, 2, 6), ShardSpec(dim=2, world=W, full=6, chunks=3)),
    "whole_1d": ((6,), None),
    "whole_3d": ((2, 3, 4), None),
}


def _check(full, chunks):
    for c in chunks:
        where = tuple(slice(o, o + n) for o, n in zip(c.offsets, c.view.shape))
        assert torch.equal(full[where], c.view), c.offsets
    return sum(c.view.numel() for c in chunks)


@pytest.mark.parametrize("name", list(SPECS))
def test_chunks_place_every_local_element_at_its_full_offset(name):
    shape, spec = SPECS[name]
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    owned = 0
    for rank in range(W):
        local = full.clone() if spec is None else shard(full, spec, rank)
        real = local.numel() if spec is None else int(shard(torch.ones(shape), spec, rank).sum())  # no padding
        assert _check(full, chunks_of(local, spec, rank).chunks) == real
        owned += sum(c.view.numel() for c in chunks_of(local, spec, rank).chunks if c.owner)
        for a in range(local.numel() + 1):  # every flat range: what a ZeRO slice can be
            for b in range(a, local.numel() + 1):
                got = flat_chunks_of(local.reshape(-1)[a:b].clone(), tuple(local.shape), spec, rank, a)
                assert _check(full, got.chunks) == int((shard(torch.ones(shape), spec, rank) if spec else
                                                        torch.ones(shape)).reshape(-1)[a:b].sum())
    assert owned == full.numel() * (W if spec is None else 1)  # a copied slice is owned by one rank


@pytest.mark.parametrize("blocks", [1, 2])
def test_two_sharded_dimensions_place_each_ranks_block(blocks):
    """A 3-D expert weight under ep x etp: experts over ep (dim 0, the ep rank), each one's width over tp
    (dim 1, ``blocks`` equal blocks each split: a concatenated [gate; up]); every rank's block placed exactly."""
    full = torch.randn(4, 8, 3, generator=torch.Generator().manual_seed(0))
    seen = torch.zeros(full.shape)
    for ep_rank in range(W):
        spec = ShardSpec(dim=0, world=W, full=4, at_rank=ep_rank, inner=ShardSpec(dim=1, world=W, full=8, chunks=blocks))
        for tp_rank in range(W):
            local = shard(full, spec, tp_rank)
            assert local.shape == (2, 4, 3)
            chunks = chunks_of(local, spec, tp_rank)
            assert chunks.shape == full.shape and _check(full, chunks.chunks) == local.numel()
            for c in chunks.chunks:
                seen[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.view.shape))] += 1
            for a, b in ((0, 5), (5, 17), (17, local.numel())):  # ZeRO slices crossing rows and blocks
                got = flat_chunks_of(local.reshape(-1)[a:b].clone(), tuple(local.shape), spec, tp_rank, a)
                assert _check(full, got.chunks) == b - a
    assert torch.equal(seen, torch.ones(full.shape))  # the four blocks tile the tensor once
