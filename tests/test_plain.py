"""Plain checkpoints in and out of a tp=2 x pp=2 run: a single-device Lightning checkpoint and a
Hugging Face save_pretrained directory (one file, or shards with an index) load into the sharded
stages; consolidate writes back what the single-device project loads."""

import copy
import os

import lightning as L
import pytest
import torch

import dist
from lightning_tp import MegaStrategy, save_consolidated
from lightning_tp.checkpoints.plain import read_full_state_dict
from models import LossRecorder, TokenData, make_model, trainer_kwargs


class SaveAtStart(L.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


def _run(rank, world, kind, plain, out_dir):
    model, rec = make_model(kind, layers=4) if kind.startswith("hf_") else make_model(kind, n_layer=4), LossRecorder()
    strategy = MegaStrategy(tp=2, pp=2, microbatches=2, load_full=plain, timeout=60)
    saver = SaveAtStart(os.path.join(out_dir, "start.ckpt"))
    trainer = L.Trainer(devices=world, strategy=strategy, max_steps=1, callbacks=[rec, saver], **trainer_kwargs())
    trainer.fit(model, TokenData(4, 64, 4))
    if rank == 0:
        save_consolidated(os.path.join(out_dir, "start.ckpt"), os.path.join(out_dir, "plain_again.ckpt"))
    return rec.losses


def _single_device_first_loss(model):
    rec = LossRecorder()
    trainer = L.Trainer(devices=1, max_steps=1, callbacks=[rec], use_distributed_sampler=False, **trainer_kwargs())
    trainer.fit(model, TokenData(4, 64, 4, single=True))
    return rec.losses[0]


@pytest.mark.parametrize("kind", ["gpt", "hf_llama", "hf_llama_sharded"])
def test_plain_checkpoint_in_and_out(tmp_path, kind):
    sharded = kind.endswith("_sharded")
    kind = kind.removesuffix("_sharded")
    make = (lambda: make_model(kind, layers=4)) if kind.startswith("hf_") else (lambda: make_model(kind, n_layer=4))
    torch.manual_seed(123)
    source = make()
    with torch.no_grad():  # weights unlike the seeded init, so loading them is visible
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if kind == "gpt":
        plain = str(tmp_path / "single.ckpt")
        torch.save({"state_dict": source.state_dict()}, plain)  # what a single-device Trainer writes
    else:
        plain = str(tmp_path / "hf")
        source.model.save_pretrained(plain, **(dict(max_shard_size="20KB") if sharded else {}))
        assert os.path.exists(os.path.join(plain, "model.safetensors.index.json")) == sharded
    losses = dist.run(4, _run, kind, plain, str(tmp_path))
    expected = _single_device_first_loss(copy.deepcopy(source))
    assert all(abs(r[0] - expected) < 1e-5 for r in losses)
    fresh = make()
    state = torch.load(tmp_path / "plain_again.ckpt", weights_only=True)["state_dict"]
    fresh.load_state_dict(state, strict=True)
    for key, value in source.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=0, rtol=0, msg=lambda m: f"{key}: {m}")
    # load_full also takes one of this project's sharded checkpoint directories (merged in one process)
    merged = read_full_state_dict(tmp_path / "start.ckpt")
    for key, value in source.state_dict().items():
        torch.testing.assert_close(merged[key], value, atol=0, rtol=0, msg=lambda m: f"{key}: {m}")


def _save_bin(state: dict, path, shards: int) -> None:
    """``pytorch_model.bin`` (one shard), or ``shards`` ``pytorch_model-0000k-of-0000n.bin`` files and their index."""
    import json

    os.makedirs(path)
    if shards == 1:
        torch.save(state, path / "pytorch_model.bin")
        return
    keys, weight_map = sorted(state), {}
    for k in range(shards):
        name = f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
        part = keys[k::shards]
        torch.save({key: state[key] for key in part}, path / name)
        weight_map.update({key: name for key in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("safe", [True, False])
def test_sharded_hf_directory_reads_like_one_file(tmp_path, safe):
    """model.safetensors.index.json / pytorch_model.bin.index.json plus several shard files."""
    model = make_model("hf_llama").model
    if safe:
        model.save_pretrained(tmp_path / "one")
        model.save_pretrained(tmp_path / "many", max_shard_size="20KB")
    else:  # as transformers 4.x's safe_serialization=False wrote them (5.x writes safetensors only)
        _save_bin(model.state_dict(), tmp_path / "one", 1)
        _save_bin(model.state_dict(), tmp_path / "many", 6)
    index = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    assert os.path.exists(tmp_path / "many" / index) and len(os.listdir(tmp_path / "many")) > 4
    one, many = read_full_state_dict(tmp_path / "one"), read_full_state_dict(tmp_path / "many")
    assert set(one) == set(many) and len(one) > 10
    for key, value in one.items():
        assert torch.equal(many[key], value), key
    os.remove(tmp_path / "many" / sorted(f for f in os.listdir(tmp_path / "many") if "-of-" in f)[0])
    with pytest.raises(ValueError, match="lists .*, which are not in the directory"):
        read_full_state_dict(tmp_path / "many")


class _Runs:
    """A pickle that would run code when loaded (writes a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path):
    from lightning_tp.checkpoints.files import META, consolidate, safe_load
    from lightning_tp.checkpoints.plain import read_full_state_dict

    marker = tmp_path / "ran"
    crafted = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "x": _Runs(str(marker))}, crafted)
    sharded = tmp_path / "sharded.ckpt"
    sharded.mkdir()
    torch.save({"lightning_tp": {"tp": 1, "pp": 1}, "x": _Runs(str(marker))}, sharded / META)
    for load in (lambda: safe_load(crafted), lambda: read_full_state_dict(crafted), lambda: consolidate(sharded)):
        with pytest.raises(ValueError, match="does not run code"):
            load()
    assert not marker.exists()
