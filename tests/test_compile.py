"""Blocks compiled by the user (``block.compile()``) under a pipeline: the stage wrappers run inside
the compiled call, and zero bubble's split leaves a compiled region whole (it computes its weight
gradients with its input's, once: a second backward through it is refused). Against the same
module uncompiled on one process. Under tp and sp: the same numbers as uncompiled blocks. (Lightning
itself refuses ``trainer.fit(torch.compile(model))`` with any strategy but single-device, DDP and FSDP.)"""

from __future__ import annotations

import lightning as L
import torch

import dist
from helpers import Net, net_loader
from lightning_tp import MegaStrategy

SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1")
# dynamo and AOTAutograd are what meet this project's code (stage wrappers, autograd Functions, the split
# backward): compiled with aot_eager here; inductor's C++ code generation cost ~40 s of a cold run, so one run
# keeps it (tp=2 + sp below)
BACKEND = "aot_eager"


class CompiledBlocks(Net):
    def __init__(self):
        super().__init__()
        for block in self.blocks:
            block.compile(backend=BACKEND)


class Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _fit(model, world, schedule=None, overlap=None, **options):
    seen = Losses()
    strategy = "auto" if world == 1 else MegaStrategy(
        pp=2, microbatches=2, schedule=schedule, virtual_stages=2 if schedule == "interleaved_1f1b" else 1, timeout=120,
        **options)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[seen])
    trainer.fit(model, net_loader())
    if overlap is not None:  # dp: (buckets the last step's backward started, buckets a backward may start)
        overlap.extend([trainer.strategy._grads.overlap.launched_early, trainer.strategy._grads.overlap.early_buckets])
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("blocks.")
               and not getattr(v, "is_meta", False) and v.numel()}
    return seen.losses, weights


def _each_schedule(rank, world):
    return {s: _fit(CompiledBlocks(), world, s) for s in SCHEDULES}


def _as_one_process(per_rank: list, names) -> None:
    """Each rank's runs (name -> (losses, weights)) against one process's run of the uncompiled module."""
    ref_losses, ref_weights = _fit(Net(), 1)
    for rank, got in enumerate(per_rank):
        assert set(got) == set(names)
        for name, (losses, weights) in got.items():
            torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0, msg=name)
            assert weights, (name, rank)
            for key, value in weights.items():  # this rank's blocks (the others are placeholders here)
                torch.testing.assert_close(value, ref_weights[key], atol=1e-5, rtol=0, msg=f"{name} {key}")


def test_compiled_blocks_train_as_one_process_under_each_schedule():
    _as_one_process(dist.run(2, _each_schedule, timeout=600), SCHEDULES)


# activation checkpointing around compiled blocks: torch's checkpoint (1F1B; ZB-H1, whose split leaves a
# compiled region whole, so B recomputes and runs the whole backward) and ZB-H1's zb_keep_recomputed
CHECKPOINTED = {"1f1b": {}, "zb_h1": {}, "zb_h1 keep": dict(zb_keep_recomputed=True)}


def _checkpointed(rank, world):
    return {name: _fit(CompiledBlocks(), world, name.split()[0], activation_checkpointing=True, **options)
            for name, options in CHECKPOINTED.items()}


def test_compiled_blocks_with_activation_checkpointing_train_as_one_process():
    """The checkpoint wrapper sits on each block's forward, inside its compiled call (it still saves
    less there: a block of these saves 2368 bytes a microbatch checkpointed, 4384 without)."""
    _as_one_process(dist.run(2, _checkpointed, timeout=600), CHECKPOINTED)


def _zb_with_dp(rank, world):
    overlap = []
    return _fit(CompiledBlocks(), world, "zb_h1", overlap), overlap


def test_compiled_stages_under_zb_h1_start_their_dp_sync_in_the_backward():
    """pp=2 x dp=2 (both replicas on the same batches: the average is one process's gradient). A stage
    of compiled blocks runs its whole backward at B, so its gradients are final at the chunk's last B:
    the dp overlap starts every bucket there, not after the step."""
    ref_losses, _ = _fit(Net(), 1)
    for rank, ((losses, _), (launched, buckets)) in enumerate(dist.run(4, _zb_with_dp, timeout=600)):
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0, msg=f"rank {rank}")
        assert launched == buckets > 0, (rank, launched, buckets)


def _tp_runs(rank, world):
    """The example GPT under tp=2 (and with sp), its blocks compiled or not, on the same data."""
    from models import LossRecorder, TokenData, make_model, trainer_kwargs, vocab_of

    out = {}
    for sp in (False, True):
        for compiled in (False, True):
            model = make_model("gpt", n_layer=2)
            for block in model.model.transformer.h if compiled else ():
                block.compile(backend="inductor" if sp else BACKEND)
            rec = LossRecorder()
            trainer = L.Trainer(devices=world, strategy=MegaStrategy(tp=2, sp=sp, timeout=120), max_steps=4,
                                callbacks=[rec], use_distributed_sampler=False, **trainer_kwargs())
            trainer.fit(model, TokenData(4 * 8, vocab_of(model), 8))
            out[(sp, compiled)] = rec.losses
    return out


def test_compiled_blocks_give_the_same_numbers_under_tp_and_sp():
    """The tp layers' collectives (autograd Functions of lightning_tp.comm) inside compiled blocks; the
    uncompiled runs are the parity suite's, checked against one process there."""
    for got in dist.run(2, _tp_runs, timeout=600):
        for sp in (False, True):
            assert len(got[(sp, False)]) == 4
            torch.testing.assert_close(got[(sp, True)], got[(sp, False)], atol=1e-5, rtol=0, msg=f"sp={sp}")
