"""Checkpoints: one directory each, written under a temporary name and renamed into place. The tensors
are chunks of the single-device ones (DCP, see :mod:`.checkpoints.layout_free`), so any layout resumes
them. See docs/checkpoints.md and docs/design/checkpoints-internals.md."""

from __future__ import annotations

import glob
import os
import pickle
import shutil
import uuid
from pathlib import Path

import torch

from .checkpoints import dcp_io, layout_free, legacy
from .failures import raise_on_every_rank

META = "meta.pt"


def safe_load(path):
    """``torch.load`` of tensors and plain data only (``weights_only=True``): a file's pickle never runs code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds objects other than tensors and plain data, and lightning_tp does not run code "
                         f"from a file it loads (weights_only=True). If you trust the file, load it yourself with "
                         f"torch.load(..., weights_only=False) and save what you need as tensors. ({e})") from None


def save(checkpoint: dict, path, mesh, module, optimizers, barrier, broadcast) -> None:
    """Called on every rank with the same ``path``; ``barrier``/``broadcast`` are the strategy's."""
    path = Path(path)
    token = broadcast(uuid.uuid4().hex[:8])
    tmp = path.with_name(f"{path.name}.tmp-{token}")
    if mesh.rank == 0:
        for stale in path.parent.glob(f"{glob.escape(path.name)}.tmp-*"):  # left by an earlier crash
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=False)
    barrier()
    tensors, described = layout_free.tensors_to_save(checkpoint, module, optimizers, mesh.tp_rank)
    described = layout_free.gather_descriptions(described)
    dcp_io.save(tensors, tmp)
    if mesh.rank == 0:
        skip = {"state_dict", "optimizer_states", *described["model_like"]}
        meta = {k: v for k, v in checkpoint.items() if k not in skip}
        meta["lightning_tp"] = dict(described, format=layout_free.FORMAT, tp=mesh.tp, pp=mesh.pp, dp=mesh.dp,
                                    ep=mesh.ep)
        torch.save(meta, tmp / META)
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


def _meta(path) -> dict:
    if not is_sharded(path):
        raise ValueError(f"{path} is not a lightning_tp checkpoint directory (no {META} in it).")
    return safe_load(Path(path) / META)


def load(path, mesh, module, optimizers, device) -> dict:
    """This rank's view of a checkpoint: trainer state, its own tensors loaded into ``module`` (any layout),
    and the optimizers' state dicts in this layout. A checkpoint refused on one rank is refused on all."""
    box = {}

    def check():
        meta = _meta(path)
        if meta.get("lightning_tp", {}).get("format", 1) < layout_free.FORMAT:
            box["checkpoint"] = legacy.load(path, meta, mesh, safe_load)
        else:
            box["prepared"], box["checkpoint"] = layout_free.prepare(path, meta, module, optimizers, mesh.tp_rank,
                                                                     mesh.tp)

    raise_on_every_rank(f"loading checkpoint {path}", check, mesh.rank, device)
    if "prepared" in box:
        layout_free.fill(path, box["prepared"])
    return box["checkpoint"]


def consolidate(path) -> dict:
    """Merge a checkpoint directory into a plain state_dict for the original single-device module."""
    meta = _meta(path)
    if meta["lightning_tp"].get("format", 1) < layout_free.FORMAT:
        return legacy.consolidate(path, meta, safe_load)
    index = dcp_io.read_index(path)
    dcp_io.check_complete(path, index)
    names = [n for n in index.state_dict_metadata if n.startswith("model/")]
    return {n[len("model/"):]: t for n, t in dcp_io.read_whole(path, index, names).items()}
