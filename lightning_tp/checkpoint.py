"""Sharded checkpoints: one directory per checkpoint, one file per model-parallel rank, written under a
temporary name and renamed into place. See docs/design/checkpoints-internals.md."""

from __future__ import annotations

import glob
import pickle
import os
import shutil
import uuid
from pathlib import Path

import torch

from .layers.shard import ShardSpec, spec_of, unshard

META = "meta.pt"
FORMAT = 1


def safe_load(path):
    """``torch.load`` of tensors and plain data only (``weights_only=True``): a file's pickle never runs code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds objects other than tensors and plain data, and lightning_tp does not run code "
                         f"from a file it loads (weights_only=True). If you trust the file, load it yourself with "
                         f"torch.load(..., weights_only=False) and save what you need as tensors. ({e})") from None


def shard_file(tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
    """A shard's file name; expert-parallel ranks past the first hold other experts (``_ep{n}``)."""
    return f"model_tp{tp_rank}_pp{pp_rank}" + (f"_ep{ep_rank}" if ep_rank else "") + ".pt"


def shard_specs(module: torch.nn.Module) -> dict:
    """state-dict key -> ShardSpec as a dict, for every sharded parameter (tied names included)."""
    return {name: spec_of(p).as_dict() for name, p in module.named_parameters(remove_duplicate=False)
            if spec_of(p) is not None}


def save(checkpoint: dict, path, mesh, module, barrier, broadcast) -> None:
    """Called on every rank with the same ``path``; ``barrier``/``broadcast`` are the strategy's."""
    path = Path(path)
    token = broadcast(uuid.uuid4().hex[:8])
    tmp = path.with_name(f"{path.name}.tmp-{token}")
    checkpoint = dict(checkpoint)
    shard = {"state_dict": checkpoint.pop("state_dict", {}),
             "optimizer_states": checkpoint.pop("optimizer_states", []),
             "specs": shard_specs(module),
             # the rest as this rank has it: what callbacks and on_save_checkpoint add may be this rank's
             # own (EMAWeightAveraging's current_model_state holds its shards)
             "rest": dict(checkpoint)}
    if mesh.rank == 0:
        for stale in path.parent.glob(f"{glob.escape(path.name)}.tmp-*"):  # left by an earlier crash
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=False)
    barrier()
    if mesh.edp_rank == 0:  # the first replica; under ep, the first of each expert shard
        torch.save(shard, tmp / shard_file(mesh.tp_rank, mesh.pp_rank, mesh.ep_rank))
    if mesh.rank == 0:
        checkpoint["lightning_tp"] = {"format": FORMAT, "tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp, "ep": mesh.ep}
        torch.save(checkpoint, tmp / META)
    barrier()
    if mesh.rank == 0:
        old = path.with_name(f"{path.name}.old-{token}")
        if path.exists():
            os.replace(path, old) if path.is_dir() else path.rename(old)
        os.replace(tmp, path)
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    barrier()


def is_sharded(path) -> bool:
    return Path(path).is_dir() and (Path(path) / META).is_file()


def load(path, mesh) -> dict:
    """This rank's view of a sharded checkpoint: trainer state plus its own shard."""
    path = Path(path)
    meta = safe_load(path / META)
    layout = meta.get("lightning_tp", {})
    if (layout.get("tp"), layout.get("pp"), layout.get("ep", 1)) != (mesh.tp, mesh.pp, mesh.ep):
        raise ValueError(
            f"checkpoint {path} was saved with tp={layout.get('tp')}, pp={layout.get('pp')}, ep={layout.get('ep', 1)} "
            f"but this run has tp={mesh.tp}, pp={mesh.pp}, ep={mesh.ep}. Resume with the same layout, or turn it into "
            f"a plain state_dict with lightning_tp.consolidate({str(path)!r}).")
    shard = safe_load(path / shard_file(mesh.tp_rank, mesh.pp_rank, mesh.ep_rank))
    shard.pop("specs", None)
    meta.update(shard.pop("rest", {}))  # this rank's own (dp rank 0's, as DDP keeps rank 0's)
    meta.update(shard)
    return meta


def consolidate(path) -> dict:
    """Merge a sharded checkpoint into a plain state_dict for the original single-device module."""
    path = Path(path)
    if not is_sharded(path):
        raise ValueError(f"{path} is not a lightning_tp checkpoint directory (no {META} in it).")
    meta = safe_load(path / META)
    layout = meta["lightning_tp"]
    merged: dict = {}
    for pp_rank, ep_rank in [(p, e) for p in range(layout["pp"]) for e in range(layout.get("ep", 1))]:
        files = [safe_load(path / shard_file(t, pp_rank, ep_rank)) for t in range(layout["tp"])]
        specs = {k: ShardSpec(**v) for k, v in files[0]["specs"].items()}
        shards = [f["state_dict"] for f in files]
        for key, value in shards[0].items():
            if key in specs:
                merged[key] = unshard([s[key] for s in shards], specs[key])
            elif key not in merged:
                merged[key] = value
    return merged
