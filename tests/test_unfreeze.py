"""Layers a fine-tuning callback unfreezes mid-run (unknown to the dp overlap built at setup) are
averaged over dp after the backward: dp=2 against one process, plain SGD without clipping (either
would hide a wrong gradient scale: clipping rescales every step, Adam ignores a uniform scale)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import dist
from lightning_tp import MegaStrategy, consolidate
from models import LossRecorder, TokenData, trainer_kwargs

STEPS, BATCH, VOCAB, D, AT = 10, 4, 32, 16, 3  # AT: the batch_idx at which the frozen layers are unfrozen
FROZEN = ("emb.", "blocks.0.")  # parameter-name prefixes frozen at setup: 1 + 4 parameters
TOL = 1e-5

# name -> MegaStrategy kwargs, all at dp=2 (two processes); the default has no ZeRO
RUNS = {
    "dp2": dict(),
    "dp2_m2": dict(microbatches=2),  # the pipeline runner at one stage: the overlap hooked per microbatch
    "dp2_zero1": dict(zero=1),  # frozen at setup: outside zero=1's buckets, averaged whole
}


class Unfreezable(L.LightningModule):
    """Embedding, two residual blocks, norm, head; the embedding and the first block frozen at setup,
    the optimizer (plain SGD) over every parameter so they are stepped once unfrozen."""

    def __init__(self):
        super().__init__()
        L.seed_everything(0, verbose=False)
        self.emb, self.norm, self.head = nn.Embedding(VOCAB, D), nn.LayerNorm(D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D)) for _ in range(2))
        for name, p in self.named_parameters():
            p.requires_grad_(not name.startswith(FROZEN))

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Unfreeze(L.Callback):
    """At batch ``AT``, before its forward: every parameter frozen at setup becomes trainable."""

    def __init__(self):
        self.unfrozen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == AT:
            self.unfrozen = [p for n, p in pl_module.named_parameters() if n.startswith(FROZEN)]
            assert len(self.unfrozen) == 5 and not any(p.requires_grad for p in self.unfrozen)
            for p in self.unfrozen:
                p.requires_grad_(True)


def _fit_all(rank, world, runs, ckdir):
    out = {}
    for name, strategy_kw in runs.items():
        model, rec, unfreeze = Unfreezable(), LossRecorder(), Unfreeze()
        strategy = MegaStrategy(**strategy_kw, timeout=120)
        trainer = L.Trainer(devices=world, strategy=strategy, max_steps=STEPS, callbacks=[rec, unfreeze],
                            **trainer_kwargs())
        trainer.fit(model, TokenData(STEPS * BATCH * world, VOCAB, BATCH))
        overlap = trainer.strategy._grads.overlap
        path = f"{ckdir}/{name}.ckpt"
        trainer.save_checkpoint(path)
        out[name] = dict(losses=rec.losses, weights=consolidate(path) if rank == 0 else None,
                         own={n: p.detach().clone() for n, p in model.named_parameters()},
                         # the path under test: parameters the dp overlap (if any) built at setup does not know
                         unknown=sum(overlap is None or id(p) not in overlap.bucket_of for p in unfreeze.unfrozen))
    return out


def _reference(batch):
    """The same seeded module and callback trained by Lightning on one process: the ground truth."""
    model, rec = Unfreezable(), LossRecorder()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(devices=1, max_steps=STEPS, callbacks=[rec, Unfreeze()], use_distributed_sampler=False,
                        **trainer_kwargs())
    trainer.fit(model, TokenData(STEPS * batch, VOCAB, batch, single=True))
    return rec.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, initial


def test_unfrozen_mid_run_matches_one_process(tmp_path):
    results = dist.run(2, _fit_all, RUNS, str(tmp_path), timeout=300)
    ref_losses, ref_weights, initial = _reference(BATCH * 2)
    assert ref_losses[-1] < ref_losses[0] - 0.05, "the reference did not learn: the comparison would be vacuous"
    for key in ("emb.weight", "blocks.0.1.weight"):  # the unfrozen layers moved: their steps count
        assert not torch.allclose(ref_weights[key], initial[key], atol=1e-3, rtol=0), key
    for name in RUNS:
        got = results[0][name]
        assert got["unknown"] == 5, (name, got["unknown"])
        assert len(got["losses"]) == len(ref_losses) == STEPS
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), atol=TOL, rtol=0,
                                   msg=lambda m: f"{name} losses: {m}")
        assert set(got["weights"]) == set(ref_weights), name
        for key, ref in ref_weights.items():
            torch.testing.assert_close(got["weights"][key], ref, atol=TOL, rtol=0,
                                       msg=lambda m: f"{name} {key}: {m}")
        for key, value in got["own"].items():  # the replicas stay bit-identical
            assert torch.equal(value, results[1][name]["own"][key]), (name, key)
