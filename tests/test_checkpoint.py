"""Sharded checkpoints in one 2-process launch (tp=2, sp, also with EMA weight averaging; pp=2
interleaved; an encoder-decoder at pp=2): exact resume, a crash mid-save that leaves the previous checkpoint
whole, consolidation into the original single-device module. In one process: a meta.pt holding objects is
refused alike on every path, and an asynchronous save holds the weights as they were when it returned."""

import os
import time
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import dist
from lightning_tp.checkpoints import files as C
from lightning_tp import MegaStrategy, consolidate
from models import LossRecorder, TokenData, Tokens, make_model, trainer_kwargs

EPOCHS, BATCHES, BATCH = 4, 3, 4


TP = dict(tp=2, sp=True)
# pipeline: each rank saves its stage (two chunks each here) and resumes it, optimizer state included
PP = dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=2)
# an encoder-decoder (Lightning's demo nn.Transformer): the decoder's stage saves its embedding copy
ED = dict(pp=2, microbatches=2)


def _fit(world, ckdir, ckpt_path=None, epochs=EPOCHS, layout=TP, kind="gpt", **model_kw):
    model = make_model(kind, n_layer=4 if "pp" in layout else 2, **model_kw) if kind == "gpt" else make_model(kind)
    rec = LossRecorder()
    saver = ModelCheckpoint(dirpath=ckdir, filename="{epoch}", every_n_epochs=1, save_top_k=-1, save_last=True)
    kw = trainer_kwargs(enable_checkpointing=True)
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(**layout, timeout=60), max_epochs=epochs,
                        callbacks=[rec, saver], **kw)
    data = TokenData(BATCHES * BATCH, 64, BATCH)  # Lightning shuffles with a seeded, epoch-keyed sampler
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model, trainer, rec.losses


def _scenario(rank, world, ckdir):
    out = {}
    model, trainer, out["full"] = _fit(world, ckdir)
    x, y = Tokens(4, 64)[0]
    out["final_loss"] = float(model.model(x[None], y[None])[1])

    # resume from the end of epoch 2 (of 4) into a fresh module
    _, _, out["resumed"] = _fit(world, ckdir + "_resumed", ckpt_path=os.path.join(ckdir, "epoch=1.ckpt"))

    # a crash while overwriting last.ckpt: every rank fails writing its tensors
    last = os.path.join(ckdir, "last.ckpt")
    step_before = C.safe_load(os.path.join(last, C.META))["global_step"]

    def failing_write(*args, **kwargs):
        raise OSError("disk full (simulated)")

    model2, trainer2, _ = _fit(world, ckdir + "_crash", epochs=1)
    with mock.patch.object(C.dcp_io._SavePlanner, "resolve_data", failing_write):
        try:
            trainer2.save_checkpoint(last)
            out["crash_raised"] = False
        except Exception as e:  # DCP reports a rank's write error on every rank
            out["crash_raised"] = "disk full" in str(e)
    out["after_crash_step"] = C.safe_load(os.path.join(last, C.META))["global_step"]
    out["step_before"] = step_before
    _, _, out["after_crash_resume"] = _fit(world, ckdir + "_again", ckpt_path=last, epochs=EPOCHS + 1)

    # asynchronous writes: the same checkpoints, written while training goes on
    _, _, out["async_full"] = _fit(world, ckdir + "_async", layout=dict(TP, async_save=True))
    _, _, out["async_resumed"] = _fit(world, ckdir + "_async_resumed", layout=dict(TP, async_save=True),
                                      ckpt_path=os.path.join(ckdir + "_async", "epoch=1.ckpt"))
    writer, real = C.AsyncWriter(), C.dcp_io._SavePlanner.resolve_data
    trainer2.strategy._writer = writer

    def slow(self, item):
        time.sleep(0.05)
        return real(self, item)

    with mock.patch.object(C.dcp_io._SavePlanner, "resolve_data", slow):
        start = time.monotonic()
        trainer2.save_checkpoint(last)
        out["returned_after"], out["busy"] = time.monotonic() - start, writer.busy
        writer.wait()
        out["written_after"] = time.monotonic() - start
    out["async_step"] = C.safe_load(os.path.join(last, C.META))["global_step"]  # trainer2's: one epoch
    with mock.patch.object(C.dcp_io._SavePlanner, "resolve_data", failing_write):
        trainer2.save_checkpoint(last)  # returns: the write fails behind
        try:
            writer.wait()
            out["async_crash_raised"] = False
        except RuntimeError as e:
            out["async_crash_raised"] = "disk full" in str(e)
    out["after_async_crash_step"] = C.safe_load(os.path.join(last, C.META))["global_step"]

    _, _, out["pp_full"] = _fit(world, ckdir + "_pp", layout=PP)
    _, _, out["pp_resumed"] = _fit(world, ckdir + "_pp_resumed", ckpt_path=os.path.join(ckdir + "_pp", "epoch=1.ckpt"),
                                   layout=PP)
    # EMAWeightAveraging keeps each rank's own shards of the current weights in the checkpoint
    _, _, out["ema_full"] = _fit(world, ckdir + "_ema", averaging="ema")
    _, _, out["ema_resumed"] = _fit(world, ckdir + "_ema_resumed", averaging="ema",
                                    ckpt_path=os.path.join(ckdir + "_ema", "epoch=1.ckpt"))
    _, _, out["ed_full"] = _fit(world, ckdir + "_ed", layout=ED, kind="demo_transformer")
    _, _, out["ed_resumed"] = _fit(world, ckdir + "_ed_resumed", ckpt_path=os.path.join(ckdir + "_ed", "epoch=1.ckpt"),
                                   layout=ED, kind="demo_transformer")
    return out


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    ckdir = str(tmp_path_factory.mktemp("ck") / "run")
    return dist.run(2, _scenario, ckdir), ckdir


@pytest.mark.parametrize("run", ["", "pp_", "ed_", "ema_", "async_"])
def test_resume_reproduces_the_uninterrupted_run_exactly(scenario, run):
    results, _ = scenario
    full, resumed = results[0][run + "full"], results[0][run + "resumed"]
    assert len(full) == EPOCHS * BATCHES and len(resumed) == (EPOCHS - 2) * BATCHES
    assert resumed == full[2 * BATCHES:]
    assert full[0] != full[BATCHES]  # epochs differ, so matching the right ones means something
    assert all(r[run + "resumed"] == resumed for r in results)  # every rank reports the same losses


def test_checkpoint_is_a_directory_each_rank_writes_its_part_of(scenario):
    _, ckdir = scenario
    path = os.path.join(ckdir, "epoch=3.ckpt")
    files = sorted(os.listdir(path))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", C.META]
    index = C.dcp_io.read_index(path)
    q = index.state_dict_metadata["model/model.transformer.h.0.attn.q_proj.weight"]
    assert len(q.chunks) == 2 and sum(c.sizes.numel() for c in q.chunks) == q.size.numel()  # one per tp rank
    assert len(index.state_dict_metadata["model/model.transformer.h.0.ln_1.weight"].chunks) == 1  # written once


def test_crash_mid_save_leaves_previous_checkpoint_loadable(scenario):
    results, _ = scenario
    r = results[0]
    assert all(res["crash_raised"] for res in results)
    assert r["after_crash_step"] == r["step_before"] == EPOCHS * BATCHES
    assert len(r["after_crash_resume"]) == BATCHES  # resumed from the intact checkpoint, one more epoch


def test_consolidate_loads_into_the_single_device_module(scenario):
    results, ckdir = scenario
    state = consolidate(os.path.join(ckdir, "epoch=3.ckpt"))
    model = make_model("gpt")
    model.load_state_dict(state, strict=True)
    x, y = Tokens(4, 64)[0]
    loss = float(model.model(x[None], y[None])[1])
    assert abs(loss - results[0]["final_loss"]) < 1e-5
    assert abs(loss - float(make_model("gpt").model(x[None], y[None])[1])) > 1e-3  # training changed it


def test_asynchronous_save_returns_before_the_write_and_keeps_the_previous_checkpoint_on_failure(scenario):
    results, _ = scenario
    for r in results:
        assert r["async_full"] == r["full"]  # the same run, the same checkpoints (resumed above)
        assert r["busy"] and r["returned_after"] < r["written_after"] / 3, r
        assert r["async_step"] == BATCHES
        assert r["async_crash_raised"] and r["after_async_crash_step"] == BATCHES


def _pickled_meta(world, ckdir):
    """A checkpoint whose meta.pt holds a pickled object, read by every path that takes a checkpoint."""
    import argparse

    import torch

    from lightning_tp import export

    _fit(world, ckdir, epochs=1, layout=dict(tp=1))
    path = os.path.join(ckdir, "last.ckpt")
    meta = C.safe_load(os.path.join(path, C.META))
    torch.save(dict(meta, hparams=argparse.Namespace(lr=1.0)), os.path.join(path, C.META))
    said = {}
    for name, read in [("ckpt_path", lambda: _fit(world, ckdir + "_again", ckpt_path=path, layout=dict(tp=1))),
                       ("load_full", lambda: _fit(world, ckdir + "_full", layout=dict(tp=1, load_full=path))),
                       ("consolidate", lambda: consolidate(path)),
                       ("export", lambda: export(path, os.path.join(ckdir, "plain.safetensors")))]:
        try:
            read()
            said[name] = None
        except Exception as e:  # noqa: BLE001 - returned to the test
            said[name] = f"{type(e).__name__}: {e}"
    return said


def _changed_after_async_save(world, ckdir):
    """Weights changed in place after an asynchronous save_checkpoint returned, while its write waits: the
    checkpoint's weights and the weights at save time."""
    import threading

    import torch

    model, trainer, _ = _fit(world, ckdir, epochs=1, layout=dict(tp=1, async_save=True))
    trainer.strategy._writer.wait()
    at_save = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gate, real = threading.Event(), C.dcp_io._SavePlanner.resolve_data

    def gated(self, item):  # the write reads nothing until the weights have changed
        gate.wait()
        return real(self, item)

    path = os.path.join(ckdir, "changed.ckpt")
    with mock.patch.object(C.dcp_io._SavePlanner, "resolve_data", gated):
        trainer.save_checkpoint(path)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        gate.set()
        trainer.strategy._writer.wait()
    return dict(at_save=at_save, saved=consolidate(path))


def _one_process(rank, world, ckdir):
    return dict(pickled=_pickled_meta(world, ckdir + "/pickled"), changed=_changed_after_async_save(world, ckdir + "/async"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return dist.run(1, _one_process, str(tmp_path_factory.mktemp("one")), timeout=300)[0]


def test_a_meta_file_holding_objects_is_refused_with_one_message_on_every_path(one_process):
    for name, message in one_process["pickled"].items():
        assert message is not None and "holds objects other than tensors" in message, (name, message)


def test_an_asynchronous_save_holds_the_weights_as_they_were_when_it_returned(one_process):
    at_save, saved = one_process["changed"]["at_save"], one_process["changed"]["saved"]
    assert set(saved) == set(at_save)
    for key, value in at_save.items():
        assert torch.equal(saved[key], value), key
