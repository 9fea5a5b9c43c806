"""zero=1 (optimizer state sharded over dp) against the single-process ground truth, with the parity
harness of helpers.py: per-step losses and consolidated weights within its tolerances."""

import pytest

from helpers import FP16, QAT_EXACT_STEPS, check, train_launch

MOE = dict(n_expert=4, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
CLIP_ACCUMULATE = dict(gradient_clip_val=0.05, accumulate_grad_batches=2)  # clipped every step

# name: (model kind, model kwargs, strategy kwargs, trainer kwargs); the gpt model steps AdamW on an LR schedule
WORLD2 = {
    "dp2_zero1": ("gpt", {}, dict(zero=1), {}),
    "dp2_zero1_clip_accumulate": ("gpt", {}, dict(zero=1), CLIP_ACCUMULATE),
    # two param groups (decay / no decay, another lr): each steps its own slices once
    "dp2_zero1_two_groups": ("gpt_two_groups", {}, dict(zero=1), {}),
    "dp2_zero1_bf16": ("gpt", {}, dict(zero=1), dict(precision="bf16-mixed", max_steps=10)),
    "dp2_zero1_fp16": ("gpt", {}, dict(zero=1), FP16),  # GradScaler: the ranks skip or step together
    # experts split over both dp ranks: their state stays whole on each (edp = 1); the rest is sharded
    "dp2_ep2_zero1": ("gpt", MOE, dict(ep=2, zero=1), CLIP_ACCUMULATE),
}
# QAT over zero=1's slices: a delayed range folds after the step of its layer's (sliced) weight
WORLD2.update({f"dp2_zero1_int8_{r}": ("gpt", dict(quant="int8", quant_range=r),
                                       dict(zero=1, quant="int8", quant_range=r), dict(max_steps=6))
               for r in ("ema", "delayed", "learned")})
# steps within TOL before a code flip (float sums in another order; see helpers.QAT_EXACT_STEPS): a
# delayed range that never folded (QAT off) is 1.1e-4 off at step 2
QAT_EXACT_STEPS.update({"dp2_zero1_int8_ema": 5, "dp2_zero1_int8_delayed": 6, "dp2_zero1_int8_learned": 3})
WORLD4 = {
    "tp2_sp_dp2_zero1_clip_accumulate": ("gpt", {}, dict(tp=2, sp=True, zero=1), CLIP_ACCUMULATE),
    "pp2_dp2_zero1": ("gpt", {}, dict(pp=2, microbatches=2, zero=1), {}),
    # each chunk's last W starts its buckets; with accumulation none starts in the step (after the last)
    "pp2_dp2_zero1_zb_h1": ("gpt", {}, dict(pp=2, microbatches=2, schedule="zb_h1", zero=1), dict(max_steps=10)),
    "pp2_dp2_zero1_accumulate": ("gpt", {}, dict(pp=2, microbatches=2, zero=1),
                                 dict(accumulate_grad_batches=2, max_steps=10)),
    "pp2_dp2_zero1_interleaved": ("gpt", dict(n_layer=4), dict(pp=2, microbatches=2, schedule="interleaved_1f1b",
                                                                virtual_stages=2, zero=1), dict(max_steps=10)),
    # a parameter some replicas' batches do not reach (and, some steps, none): skipped as zero=0 skips it
    "tp2_dp2_zero1_sometimes_used": ("gpt_sometimes", {}, dict(tp=2, zero=1), {}),
    # experts sharded over the 2 ranks holding the same ones (edp = 2), the rest over dp = 4
    "dp4_ep2_zero1_clip": ("gpt", MOE, dict(ep=2, zero=1), dict(gradient_clip_val=0.05)),
    # ep groups over tp (folded), the experts' slices over the other dp rank holding them
    "tp2_dp2_ep2_zero1_clip": ("gpt", MOE, dict(tp=2, ep=2, zero=1), dict(gradient_clip_val=0.05)),
    # the same with two param groups (decay / no decay, another lr): experts' matrices and biases apart
    "tp2_dp2_ep2_zero1_two_groups": ("gpt_two_groups", MOE, dict(tp=2, ep=2, zero=1), dict(gradient_clip_val=0.05)),
    # each expert split over the tp ranks (etp): its slices' moments over its expert-dp ranks, clipped by the whole norm
    "tp2_dp2_ep2_etp2_zero1_clip": ("gpt", MOE, dict(tp=2, ep=2, etp=2, zero=1), dict(gradient_clip_val=0.05)),
    # etp below tp: a tp group holds each expert's two slices once (the norm), the biases summed over a pair
    "tp4_ep2_etp2_zero1_clip": ("gpt", MOE, dict(tp=4, ep=2, etp=2, zero=1), dict(gradient_clip_val=0.05)),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return train_launch(2, WORLD2, tmp_path_factory, "z2")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return train_launch(4, WORLD4, tmp_path_factory, "z4")


@pytest.mark.parametrize("name", list(WORLD2))
def test_zero1_world2(world2, name):
    check(world2, name, WORLD2, 2)


def test_zero1_reduce_scatter_starts_while_the_backward_runs(world2, world4):
    """Without a pipeline every bucket whose gradients are final at the backward starts there (one bucket
    here; tp=2 + sp's norms, summed over tp first, wait for the end)."""
    for results, name in ((world2, "dp2_zero1"), (world4, "tp2_sp_dp2_zero1_clip_accumulate")):
        got = results[0][name]
        assert got["dp_overlap"] and got["buckets"] > 0, got
        if name == "dp2_zero1":
            assert got["launched_early"] == got["buckets"], got


@pytest.mark.parametrize("name", list(WORLD4))
def test_zero1_world4(world4, name):
    check(world4, name, WORLD4, 4)


def _bytes(rank, world):
    """Optimizer-state elements per rank and the dp collectives' elements per step, zero=0 then zero=1."""
    import lightning as L
    import torch
    import torch.distributed as torch_dist

    from lightning_tp import MegaStrategy, comm
    from models import TokenData, make_model, trainer_kwargs

    torch_dist.init_process_group("gloo")
    out = {}
    for zero in (0, 1):
        model = make_model("gpt")
        strategy = MegaStrategy(zero=zero, timeout=120)
        trainer = L.Trainer(devices=world, strategy=strategy, max_steps=3, **trainer_kwargs())
        with comm.count_collectives() as records:
            trainer.fit(model, TokenData(3 * 4 * world, 64, 4))
        optimizer = trainer.optimizers[0]
        state = sum(v.numel() for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        dp = [(op, n) for op, n, group in records if group is strategy.mesh.dp_group]
        out[zero] = dict(state=state, params=sum(p.numel() for p in model.parameters()),
                         tensors=len(list(model.parameters())),
                         dp={op: sum(n for o, n in dp if o == op) / 3 for op in {o for o, _ in dp}},
                         buckets=len(getattr(optimizer, "_lightning_tp_zero", None).buckets) if zero else 0,
                         flags=sum(len(b.rows) * b.flag_slots for b in optimizer._lightning_tp_zero.buckets) if zero else 0)
    return out


def test_zero1_holds_a_dp_share_of_the_optimizer_state_and_moves_an_all_reduces_bytes():
    import dist

    for r in dist.run(2, _bytes, timeout=300):
        whole, sharded = r[0], r[1]
        assert whole["state"] == 2 * whole["params"]  # AdamW: two moments per parameter
        # each rank holds half of every bucket (one bucket here; its padding at most dp - 1 elements a moment)
        assert abs(sharded["state"] - whole["state"] / 2) <= 2 * (2 - 1) * sharded["buckets"], (sharded, whole)
        # reduce-scatter + all-gather move what an all-reduce does: each the gradients' numel, both 2N
        n, tensors = whole["params"], whole["tensors"]
        rs, ag = sharded["dp"]["reduce_scatter"], sharded["dp"]["all_gather"]
        assert n <= ag < n + 2 * sharded["buckets"] and "all_reduce" not in sharded["dp"], (sharded["dp"], n)
        # the reduce-scatter also sends a has-a-gradient flag per parameter tensor and dp rank it touches: a
        # tensor split between the two ranks' ranges is flagged in both rows, rows padded to the longer one
        assert rs - ag == sharded["flags"] and tensors <= sharded["flags"] <= 2 * (tensors + 1), (sharded, tensors)
        assert whole["dp"]["all_reduce"] == n + tensors, (whole["dp"], sharded["dp"])  # zero=0: a flag each too


def _fit(world, zero, epochs, ckpt_path=None, save_dir=None, capture=None):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_tp import MegaStrategy
    from models import LossRecorder, TokenData, make_model, trainer_kwargs

    rec = LossRecorder()
    callbacks = [rec] + ([ModelCheckpoint(dirpath=save_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1)]
                         if save_dir else []) + ([capture] if capture else [])
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(zero=zero, timeout=120), max_epochs=epochs,
                        callbacks=callbacks, limit_val_batches=0, **trainer_kwargs(enable_checkpointing=bool(save_dir)))
    # two param groups (decay / no decay, another lr), as most LM recipes have
    trainer.fit(make_model("gpt_two_groups"), TokenData(3 * 4 * 2, 64, 4 * 2 // world), ckpt_path=ckpt_path)  # 3 steps an epoch
    return rec.losses


def _resume(rank, world, ckdir):
    import torch.distributed as torch_dist

    from unittest import mock

    from lightning_tp.dp.zero.optimizer import ShardedOptimizer

    torch_dist.init_process_group("gloo")
    with mock.patch.object(ShardedOptimizer, "state_dict", side_effect=AssertionError("a checkpoint gathered")):
        straight = _fit(world, 1, 2, save_dir=f"{ckdir}/a")  # each rank saves its own slices
    return dict(straight=straight, zero1=_fit(world, 1, 2, ckpt_path=f"{ckdir}/a/epoch=0.ckpt"),
                zero0=_fit(world, 0, 2, ckpt_path=f"{ckdir}/a/epoch=0.ckpt"))


def _resume_at_dp4(rank, world, ckdir):
    """The dp=2 checkpoint resumed at dp=4: the state dict (gathered) is the one saved."""
    import lightning as L
    import torch.distributed as torch_dist

    from lightning_tp.checkpoints.layout_free import state_order

    torch_dist.init_process_group("gloo")
    seen = {}

    class Capture(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["state"] = trainer.optimizers[0].state_dict()
            seen["held"] = sum(v.numel() for s in trainer.optimizers[0].state.values() for v in s.values()
                               if v.dim() > 0)
            names = {id(p): n for n, p in pl_module.named_parameters()}
            seen["names"] = [names[id(p)] for g in state_order(trainer.optimizers[0]) for p in g]

    losses = _fit(world, 1, 2, ckpt_path=f"{ckdir}/a/epoch=0.ckpt", capture=Capture())
    return dict(losses=losses, **seen)


def test_zero1_checkpoints_resume_exactly_with_zero0_and_at_another_dp_size(tmp_path):
    import dist
    import torch

    from lightning_tp.checkpoints.files import META, safe_load
    from lightning_tp.checkpoints import dcp_io

    for r in dist.run(2, _resume, str(tmp_path), timeout=300):
        assert len(r["straight"]) == 6
        for other in ("zero1", "zero0"):  # the optimizer state saved by zero=1 is zero=0's layout
            assert torch.allclose(torch.tensor(r[other]), torch.tensor(r["straight"][3:]), atol=1e-6, rtol=0), r
    path = tmp_path / "a" / "epoch=0.ckpt"
    index = dcp_io.read_index(path)
    written = {}  # each rank writes its own slices of the moments, none gathered
    for where, info in index.storage_data.items():
        if where.fqn.startswith("optim0/") and not where.fqn.endswith("/step"):
            written[info.relative_path] = written.get(info.relative_path, 0) + info.length
    assert len(written) == 2 and max(written.values()) < 0.55 * sum(written.values()), written
    saved = dcp_io.read_whole(path, index, [n for n in index.state_dict_metadata if n.startswith("optim0/")])
    total = sum(v.numel() for v in saved.values() if v.dim() > 0)
    groups = safe_load(path / META)["lightning_tp"]["optimizers"][0]["groups"]
    for r in dist.run(4, _resume_at_dp4, str(tmp_path), timeout=300):
        assert len(r["losses"]) == 3 and r["held"] <= total / 4 + 2 * 3
        assert [{k: v for k, v in g.items() if k != "params"} for g in r["state"]["param_groups"]] == groups
        assert len(r["state"]["state"]) * 3 == len(saved)  # step, exp_avg, exp_avg_sq of every weight
        for i, s in r["state"]["state"].items():
            for k, v in s.items():
                assert torch.equal(saved[f"optim0/{r['names'][i]}/{k}"], v), (i, k)


def _bad(rank, world):
    import warnings

    import torch
    import torch.distributed as torch_dist

    from helpers import expect_error
    from lightning_tp import MegaStrategy
    from models import make_model

    torch_dist.init_process_group("gloo")

    class WithLBFGS(type(make_model("gpt"))):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters())

    out = {}
    model = make_model("gpt")
    model.__class__ = WithLBFGS
    out["lbfgs"] = expect_error(world, model, MegaStrategy(zero=1, timeout=60))[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["tp2_dp1"] = expect_error(world, make_model("gpt"), MegaStrategy(tp=2, zero=1, timeout=60))[0]
    out["warned"] = [str(w.message) for w in caught if "zero=1" in str(w.message)]
    return out


def test_zero1_refuses_an_optimizer_it_cannot_shard_on_every_rank_and_warns_at_dp1():
    import dist

    got = dist.run(2, _bad, timeout=300)
    for r in got:
        assert r["lbfgs"] is not None and "LBFGS is not known to" in r["lbfgs"] and "Use zero=0" in r["lbfgs"], r
        assert r["tp2_dp1"] is None  # trains, unsharded
    assert any("dp=1 here" in w and "nothing is sharded" in w for w in got[0]["warned"]), got[0]["warned"]
