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
    "gpt_tp2_dp2_zero1_to_pp2_dp2_zero1": ("gpt", {}, (4, dict(tp=2, zero=1)), (4, dict(PP, zero=1))),  # slices moved
    # zero=3: FSDP2's DTensor shards (runs of whole rows) written and read as chunks, moments included
    "gpt_tp2_dp2_zero3_to_pp2_dp2_zero1": ("gpt", {}, (4, dict(tp=2, zero=3)), (4, dict(PP, zero=1))),
    "gpt_tp2_sp_dp2_zero1_to_tp2_dp2_zero3": ("gpt", {}, (4, dict(tp=2, sp=True, zero=1)), (4, dict(tp=2, zero=3))),
    "gpt_dp4_zero3_to_dp2_zero3": ("gpt", {}, (4, dict(zero=3)), (2, dict(zero=3))),
    "llama_tp2_to_pp2": ("hf_llama", {}, (2, dict(tp=2)), (2, PP)),  # GQA: 4 heads, 2 kv heads
    "llama_tp4_to_tp2_sp": ("hf_llama", {}, (4, dict(tp=4)), (2, dict(tp=2, sp=True))),  # kv heads copied at tp=4
    "llama_tp2_dp2_to_tp4": ("hf_llama", {}, (4, dict(tp=2)), (4, dict(tp=4))),  # resumed into copied kv heads
    "llama_pp2_to_tp2_sp": ("hf_llama", {}, (2, PP), (2, dict(tp=2, sp=True))),
    "llama_tp2_pp2_to_one": ("hf_llama", {}, (4, dict(tp=2, **PP)), (1, {})),
    "llama_1f1b_to_interleaved": ("hf_llama", dict(layers=4), (2, PP),
                                  (2, dict(PP, schedule="interleaved_1f1b", virtual_stages=2))),
    "llama_dp2_zero1_to_one": ("hf_llama", {}, (2, dict(zero=1)), (1, {})),
    "llama_dp2_zero3_to_one": ("hf_llama", {}, (2, dict(zero=3)), (1, {})),
    "gpt2_tp2_to_pp2": ("hf_gpt2", {}, (2, dict(tp=2)), (2, PP)),  # q, k, v in one fused Conv1D
    "gpt2_pp2_to_tp2_sp": ("hf_gpt2", {}, (2, PP), (2, dict(tp=2, sp=True))),
    "gpt2_tp2_pp2_to_one": ("hf_gpt2", {}, (4, dict(tp=2, **PP)), (1, {})),
    "gpt2_1f1b_to_interleaved": ("hf_gpt2", dict(layers=4), (2, PP),
                                 (2, dict(PP, schedule="interleaved_1f1b", virtual_stages=2))),
    "gpt2_dp2_zero1_to_one": ("hf_gpt2", {}, (2, dict(zero=1)), (1, {})),
    "gpt2_tp2_pp2_to_tp2": ("hf_gpt2", {}, (4, dict(tp=2, **PP)), (2, dict(tp=2))),
    "mixtral_ep2_to_ep1": ("hf_mixtral", {}, (2, dict(ep=2)), (2, {})),
    # transformers 5.x: each ep rank's slice of the 3-D expert weights, then whole on each tp rank, and back
    "mixtral_ep2_to_tp2": ("hf_mixtral", {}, (2, dict(ep=2)), (2, dict(tp=2))),
    "mixtral_tp2_to_ep2": ("hf_mixtral", {}, (2, dict(tp=2)), (2, dict(ep=2))),
    # experts beyond dp: the ep group is the tp pair (folded), resumed with it over the dp pair, and the
    # example GPT's experts (a ModuleList: whole experts, one name each) from the tp pair to one process
    "mixtral_tp2_ep2_to_dp2_ep2": ("hf_mixtral", {}, (2, dict(tp=2, ep=2)), (2, dict(ep=2))),
    "gpt_moe_tp2_ep2_to_one": ("gpt", dict(n_expert=4), (2, dict(tp=2, ep=2)), (1, {})),
    # each expert split over tp (etp): its slices saved as chunks, resumed whole (folded ep), and into slices
    "gpt_moe_tp2_dp2_ep2_etp2_to_tp2_ep2": ("gpt", dict(n_expert=4), (4, dict(tp=2, ep=2, etp=2)), (2, dict(tp=2, ep=2))),
    "gpt_moe_tp2_ep2_to_tp2_etp2": ("gpt", dict(n_expert=4), (2, dict(tp=2, ep=2)), (2, dict(tp=2, etp=2))),
    # on 5.x each rank's block of 3-D expert weights: its experts (ep) by its slice of their width (etp)
    "mixtral_tp2_dp2_ep2_etp2_to_ep2": ("hf_mixtral", {}, (4, dict(tp=2, ep=2, etp=2)), (2, dict(ep=2))),
    # etp below tp: slices held by tp ranks etp apart saved once, resumed folded; and whole experts into such slices
    "mixtral_tp4_ep2_etp2_to_ep2": ("hf_mixtral", dict(kv_heads=4), (4, dict(tp=4, ep=2, etp=2)), (2, dict(ep=2))),
    "gpt_moe_tp2_dp2_ep2_to_tp4_ep2_etp2": ("gpt", dict(n_expert=4), (4, dict(tp=2, ep=2)),
                                            (4, dict(tp=4, ep=2, etp=2))),
    "gpt_first_format": ("gpt", {}, (1, {}), (1, {})),  # saved as the first format did: still resumes
    # context parallelism changes nothing in what is saved: resumed without it, and into it
    "gpt_cp2_tp2_to_pp2": ("gpt", {}, (4, dict(cp=2, tp=2)), (2, PP)),
    "gpt_pp2_dp2_to_cp2_tp2": ("gpt", {}, (4, PP), (4, dict(cp=2, tp=2))),
    "llama_cp2_tp2_to_pp2": ("hf_llama", {}, (4, dict(cp=2, tp=2)), (2, PP)),
}
FIRST_FORMAT = {"gpt_first_format"}


def _save_first_format(trainer, path):
    """What a one-process checkpoint of the first format held: meta.pt and model_tp0_pp0.pt."""
    import os

    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    os.makedirs(path)
    shard = {k: checkpoint.pop(k) for k in ("state_dict", "optimizer_states")}
    torch.save(dict(shard, specs={}, rest={}), f"{path}/model_tp0_pp0.pt")
    torch.save(dict(checkpoint, lightning_tp=dict(format=1, tp=1, pp=1, dp=1, ep=1)), f"{path}/meta.pt")


def _fit(world, kind, model_kw, layout, epochs, ckpt_path=None):
    model = make_model(kind, **model_kw)
    dp = world // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
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
        (_save_first_format if name in FIRST_FORMAT else type(trainer).save_checkpoint)(trainer, f"{ckdir}/{name}.ckpt")
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
    results = {"ckdir": ckdir}
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


class _Runs:
    """A pickle that would create a file when loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _bad(rank, world, ckdir):
    import os
    import shutil

    good = f"{ckdir}/gpt_tp2_to_pp2.ckpt"  # tp=2, 2 layers
    out = {}

    def resume(path, model=None, layout=None):
        model = model or make_model("gpt")
        trainer = L.Trainer(devices=world, strategy=MegaStrategy(**(dict(tp=2) if layout is None else layout), timeout=60),
                            max_epochs=2, **trainer_kwargs())
        try:
            trainer.fit(model, TokenData(STEPS * GLOBAL_BATCH, 64, GLOBAL_BATCH), ckpt_path=path)
        except Exception as e:  # noqa: BLE001 - returned to the test
            return f"{type(e).__name__}: {e}"

    out["first_format_at_tp2"] = resume(f"{ckdir}/gpt_first_format.ckpt")
    out["other_model"] = resume(good, make_model("gpt", n_layer=3))
    out["other_width"] = resume(good, make_model("gpt", n_embd=48))
    if rank == 0:
        for name, damage in (("truncated", lambda p: os.truncate(f"{p}/__1_0.distcp", 100)),
                             ("half_written", lambda p: os.remove(f"{p}/.metadata"))):
            shutil.copytree(good, f"{ckdir}/{name}.ckpt")
            damage(f"{ckdir}/{name}.ckpt")
    torch.distributed.barrier()
    out["truncated"] = resume(f"{ckdir}/truncated.ckpt")
    out["half_written"] = resume(f"{ckdir}/half_written.ckpt")
    # Adafactor's factored moments are shaped unlike a tp-sharded weight: only tp=2 can resume them
    model = make_model("gpt")
    model.configure_optimizers = lambda: torch.optim.Adafactor(model.parameters(), lr=1e-2)
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(tp=2, timeout=60), max_epochs=1, **trainer_kwargs())
    trainer.fit(model, TokenData(STEPS * GLOBAL_BATCH, 64, GLOBAL_BATCH))
    trainer.save_checkpoint(f"{ckdir}/adafactor.ckpt")
    model = make_model("gpt")
    model.configure_optimizers = lambda: torch.optim.Adafactor(model.parameters(), lr=1e-2)
    out["adafactor_at_tp1"] = resume(f"{ckdir}/adafactor.ckpt", model, layout={})
    model = make_model("gpt")
    model.configure_optimizers = lambda: torch.optim.Adafactor(model.parameters(), lr=1e-2)
    out["adafactor_at_tp2"] = resume(f"{ckdir}/adafactor.ckpt", model)
    return out


def test_bad_checkpoints_are_refused_on_every_rank_with_what_is_wrong(runs):
    ckdir = runs["ckdir"]
    results = dist.run(2, _bad, ckdir, timeout=300)
    for r in results:
        assert "has no tensor 'model.transformer.h.2.ln_1.weight'" in r["other_model"], r["other_model"]
        assert "'model.transformer.wte.weight' has shape (64, 32) there but (64, 48)" in r["other_width"], \
            r["other_width"]
        assert "is incomplete: __1_0.distcp holds 100 bytes of the" in r["truncated"], r["truncated"]
        assert "is incomplete: it has no .metadata" in r["half_written"], r["half_written"]
        assert "shaped unlike its sharded weight, so only tp=2 can resume it" in r["adafactor_at_tp1"], \
            r["adafactor_at_tp1"]
        assert r["adafactor_at_tp2"] is None, r["adafactor_at_tp2"]
        assert "first format, which resumes only under the layout that wrote it: tp=1" in r["first_format_at_tp2"], \
            r["first_format_at_tp2"]


def test_a_crafted_checkpoint_index_is_refused_and_runs_nothing(runs, tmp_path):
    import pickle
    import shutil

    from lightning_tp.checkpoints import dcp_io

    marker, crafted = tmp_path / "ran", tmp_path / "crafted.ckpt"
    shutil.copytree(runs["ckdir"] + "/gpt_tp2_to_pp2.ckpt", crafted)
    with open(crafted / ".metadata", "wb") as f:
        pickle.dump(_Runs(str(marker)), f)
    for load in (lambda: dcp_io.read_index(crafted), lambda: consolidate(crafted)):
        with pytest.raises(ValueError, match="without running code from it"):
            load()
    assert not marker.exists()


# a checkpoint written at tp=2 x pp=2; one of experts written at ep=2 (on transformers 5.x, slices of 3-D weights),
# and one at tp=2 x dp=2 x ep=2 x etp=2 (blocks of them: experts by width)
EXPORTS = {"gpt2_tp2_pp2": ("gpt2_tp2_pp2_to_tp2", "hf_gpt2"), "mixtral_ep2": ("mixtral_ep2_to_tp2", "hf_mixtral"),
           "mixtral_tp2_ep2_etp2": ("mixtral_tp2_dp2_ep2_etp2_to_ep2", "hf_mixtral")}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_export_of_a_checkpoint_loads_with_from_pretrained_and_gives_the_same_logits(runs, tmp_path, case):
    import subprocess
    import sys

    import transformers
    from safetensors.torch import load_file

    from models import Tokens

    name, kind = EXPORTS[case]
    ckpt = runs["ckdir"] + f"/{name}.ckpt"
    module = make_model(kind)
    module.model.config.save_pretrained(tmp_path / "config")
    for to, out in (("hf", tmp_path / "hf"), ("plain", tmp_path / "plain.safetensors")):
        args = [ckpt, "--to", to, str(out)] + (["--config", str(tmp_path / "config")] if to == "hf" else [])
        subprocess.run([sys.executable, "-m", "lightning_tp", "export", *args], check=True, capture_output=True)
    state = consolidate(ckpt)
    assert load_file(tmp_path / "plain.safetensors").keys() == state.keys()
    for key, value in load_file(tmp_path / "plain.safetensors").items():
        assert torch.equal(value, state[key]), key
    module.load_state_dict(state)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    x, _ = Tokens(4, 64)[0]
    with torch.no_grad():
        want, got = module.model(x[None]).logits, exported(x[None]).logits
    assert torch.equal(got, want)
    assert (got - make_model(kind).model(x[None]).logits).abs().max() > 1e-3  # trained weights, not fresh


def _from_lightning_model_parallel(rank, world, ckdir):
    """A checkpoint of Lightning's own ModelParallelStrategy (FSDP2 over dp=2, a DCP directory), then a
    MegaStrategy(tp=2) run started from it with load_full."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from lightning_tp.checkpoints.plain import read_full_state_dict
    from models import GPT_SMALL, ParityGPT

    class Sharded(ParityGPT):
        def configure_model(self):
            for block in self.model.transformer.h:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    L.seed_everything(0, verbose=False)
    model = Sharded(**GPT_SMALL)
    trainer = L.Trainer(devices=world, strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                        max_steps=3, **trainer_kwargs())
    trainer.fit(model, TokenData(24, 64, 4))
    path = f"{ckdir}/model_parallel.ckpt"
    trainer.save_checkpoint(path)
    trained = {k: v.full_tensor() for k, v in model.state_dict().items()}
    read = read_full_state_dict(path)
    rec = LossRecorder()
    started = make_model("gpt")
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(tp=2, load_full=path, timeout=60), max_steps=1,
                        callbacks=[rec], **trainer_kwargs())
    trainer.fit(started, TokenData(8, 64, 4))
    refused = None
    try:
        L.Trainer(devices=world, strategy=MegaStrategy(tp=2, timeout=60), max_steps=1, **trainer_kwargs()).fit(
            make_model("gpt"), TokenData(8, 64, 4), ckpt_path=path)
    except ValueError as e:
        refused = str(e)
    return dict(trained=trained, read=read, first_loss=rec.losses[0], refused=refused)


def test_a_lightning_model_parallel_checkpoint_starts_a_run_through_load_full(tmp_path):
    r = dist.run(2, _from_lightning_model_parallel, str(tmp_path), timeout=300)[0]
    assert r["read"].keys() == r["trained"].keys()
    for key, value in r["trained"].items():
        assert torch.equal(r["read"][key], value), key
    model = make_model("gpt")
    model.load_state_dict(r["read"])
    loader = TokenData(8, 64, 4, single=True).train_dataloader()  # the first batch a dp=1 run sees
    x, y = next(iter(loader))
    with torch.no_grad():
        assert abs(float(model.model(x, y)[1]) - r["first_loss"]) < TOL
    fresh = float(make_model("gpt").model(x, y)[1])
    assert abs(fresh - r["first_loss"]) > 1e-3  # the trained weights, not the seeded ones
    assert "Lightning's FSDP or ModelParallelStrategy" in r["refused"] and "load_full=" in r["refused"]


def test_a_deepspeed_checkpoint_is_not_unpickled_and_the_message_says_how_to_convert_it(tmp_path):
    from lightning_tp.checkpoints.plain import read_full_state_dict

    (tmp_path / "checkpoint").mkdir()  # what Lightning's DeepSpeedStrategy writes: DeepSpeed's own pickles
    (tmp_path / "latest").write_text("checkpoint")
    with pytest.raises(ValueError, match="convert_zero_checkpoint_to_fp32_state_dict"):
        read_full_state_dict(tmp_path)
