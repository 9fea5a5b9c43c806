"""Checkpoints move between layouts: one epoch (5 AdamW steps, an LR schedule) under layout A, saved,
then resumed under layout B for another; per-step losses and the final consolidated weights equal one
uninterrupted process within 1e-5 (the optimizer's moments resharded with the weights)."""

import lightning as L
import pytest
import torch

import dist
from helpers import TOL
from lightning_tp import MegaStrategy, consolidate
from models import LossRecorder, TokenData, make_model, reference_run, trainer_kwargs, vocab_of

STEPS, GLOBAL_BATCH = 5, 8  # steps an epoch; the global batch stays when dp changes
PP = dict(pp=2, microbatches=2)
# name -> (model kind, model kwargs, (world, layout) before, (world, layout) after)
CASES = {
    "gpt_tp2_to_pp2": ("gpt", {}, (2, dict(tp=2)), (2, PP)),
    "gpt_pp2_to_tp2_sp": ("gpt", {}, (2, PP), (2, dict(tp=2, sp=True))),
    "gpt_1f1b_to_interleaved": ("gpt", dict(n_layer=4), (2, PP),
                                (2, dict(PP, schedule="interleaved_1f1b", virtual_stages=2))),
    "gpt_tp2_pp2_to_one": ("gpt", {}, (4, dict(tp=2, **PP)), (1, {})),
    "gpt_dp2_zero1_to_one": ("gpt", {}, (2, dict(zero=1)), (1, {})),
    "llama_tp2_to_pp2": ("hf_llama", {}, (2, dict(tp=2)), (2, PP)),  # GQA: 4 heads, 2 kv heads
    "llama_tp4_to_tp2_sp": ("hf_llama", {}, (4, dict(tp=4)), (2, dict(tp=2, sp=True))),  # kv heads copied at tp=4
    "llama_pp2_to_tp2_sp": ("hf_llama", {}, (2, PP), (2, dict(tp=2, sp=True))),
    "gpt2_tp2_to_pp2": ("hf_gpt2", {}, (2, dict(tp=2)), (2, PP)),  # q, k, v in one fused Conv1D
    "gpt2_tp2_pp2_to_tp2": ("hf_gpt2", {}, (4, dict(tp=2, **PP)), (2, dict(tp=2))),
    "mixtral_ep2_to_ep1": ("hf_mixtral", {}, (2, dict(ep=2)), (2, {})),
}


def _fit(world, kind, model_kw, layout, epochs, ckpt_path=None):
    model = make_model(kind, **model_kw)
    dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
    rec = LossRecorder()
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(**layout, timeout=120), max_epochs=epochs,
                        callbacks=[rec], **trainer_kwargs())
    trainer.fit(model, TokenData(STEPS * GLOBAL_BATCH, vocab_of(model), GLOBAL_BATCH // dp), ckpt_path=ckpt_path)
    return trainer, rec.losses


def _phases(rank, world, ckdir, before, after):
    """Layout A of the cases named in ``before`` (saving), then layout B of those in ``after`` (resuming)."""
    out = {}
    for name in before:
        kind, model_kw, (_, layout), _ = CASES[name]
        trainer, losses = _fit(world, kind, model_kw, layout, 1)
        trainer.save_checkpoint(f"{ckdir}/{name}.ckpt")
        out[name + "/before"] = losses
    for name in after:
        kind, model_kw, _, (_, layout) = CASES[name]
        trainer, losses = _fit(world, kind, model_kw, layout, 2, ckpt_path=f"{ckdir}/{name}.ckpt")
        trainer.save_checkpoint(f"{ckdir}/{name}_end.ckpt")
        out[name + "/after"] = losses
        out[name + "/weights"] = consolidate(f"{ckdir}/{name}_end.ckpt") if rank == 0 else None
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckdir = str(tmp_path_factory.mktemp("reshard"))
    on = lambda w, i: [n for n, c in CASES.items() if c[i][0] == w]  # noqa: E731
    results = {}
    for world in (4, 2, 1):  # a layout on 4 ranks resumes on 2 or 1; one on 2 on 2 or 1
        results.update(dist.run(world, _phases, ckdir, on(world, 2), on(world, 3), timeout=900)[0])
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_resume_under_another_layout_matches_one_uninterrupted_process(runs, name):
    kind, model_kw, _, _ = CASES[name]
    ref_losses, ref_weights, _ = reference_run(kind, model_kw, 2 * STEPS, GLOBAL_BATCH, samples=STEPS * GLOBAL_BATCH)
    got = runs[name + "/before"] + runs[name + "/after"]
    assert len(got) == len(ref_losses) == 2 * STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), atol=TOL, rtol=0)
    assert ref_losses[-1] < ref_losses[0] - 0.05, "the reference did not learn: the comparison would be vacuous"
    weights = runs[name + "/weights"]
    assert set(weights) == set(ref_weights)
    for key, ref in ref_weights.items():
        torch.testing.assert_close(weights[key], ref, atol=TOL, rtol=0, msg=lambda m: f"{key}: {m}")
