"""Checkpoints: one directory each, written under a temporary name and renamed into place. The tensors
are chunks of the single-device ones (DCP, see :mod:`.checkpoints.layout_free`), so any layout resumes
them. See docs/checkpoints.md and docs/design/checkpoints-internals.md."""

from __future__ import annotations

import glob
import io
import os
import pickle
import shutil
import threading
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from . import dcp_io, layout_free, legacy
from ..faults.notes import raise_on_every_rank

META = "meta.pt"


def safe_load(path):
    """``torch.load`` of tensors and plain data only (``weights_only=True``): a file's pickle never runs code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds objects other than tensors and plain data, and lightning_tp does not run code "
                         f"from a file it loads (weights_only=True). If you trust the file, load it yourself with "
                         f"torch.load(..., weights_only=False) and save what you need as tensors. ({e})") from None


def _replace(tmp: Path, path: Path, token: str) -> None:
    """Put the finished ``tmp`` directory at ``path`` (rank 0): the previous checkpoint is whole until then."""
    old = path.with_name(f"{path.name}.old-{token}")
    if path.exists():
        os.replace(path, old) if path.is_dir() else path.rename(old)
    os.replace(tmp, path)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()


def save(checkpoint: dict, path, mesh, module, optimizers, barrier, broadcast, writer=None) -> None:
    """Called on every rank with the same ``path``; ``barrier``/``broadcast`` are the strategy's. ``writer``
    (an :class:`AsyncWriter`): return once this rank's tensors are copied, the files written behind."""
    path = Path(path)
    token = broadcast(uuid.uuid4().hex[:8])
    tmp = path.with_name(f"{path.name}.tmp-{token}")
    if writer is not None:
        writer.wait()  # one write in flight at a time
    if mesh.rank == 0:
        for stale in path.parent.glob(f"{glob.escape(path.name)}.tmp-*"):  # left by an earlier crash
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=False)
    barrier()
    tensors, described = layout_free.tensors_to_save(checkpoint, module, optimizers, mesh.tp_rank)
    described = layout_free.gather_descriptions(described)
    meta = None
    if mesh.rank == 0:
        skip = {"state_dict", "optimizer_states", *described["model_like"]}
        meta = io.BytesIO()  # serialized now: the trainer goes on changing what it refers to
        torch.save(dict({k: v for k, v in checkpoint.items() if k not in skip},
                        lightning_tp=dict(described, format=layout_free.FORMAT, tp=mesh.tp, pp=mesh.pp, dp=mesh.dp,
                                          ep=mesh.ep)), meta)

    def finish(group=None):
        if meta is not None:
            (tmp / META).write_bytes(meta.getvalue())
        if dist.is_initialized():
            dist.barrier(group=group)
        if mesh.rank == 0:
            _replace(tmp, path, token)

    if writer is None:
        dcp_io.save(tensors, tmp)
        finish()
        barrier()
    else:
        writer.start(*dcp_io.stage(tensors), tmp, finish)


class AsyncWriter:
    """Writes a checkpoint's staged copies in a background thread, over a gloo group of its own so the
    training's collectives go on meanwhile; its error is raised at the next :meth:`wait`."""

    def __init__(self, timeout=None):
        self.group, self.thread, self.error, self.timeout = None, None, None, timeout

    def start(self, tensors: dict, ready, tmp: Path, finish) -> None:
        """Write ``tensors`` (staged copies) once ``ready()`` returns (their copies complete), in the background."""
        if self.group is None and dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=self.timeout)

        def run():
            try:
                ready()
                dcp_io.save(tensors, tmp, group=self.group)
                finish(self.group)
                if dist.is_initialized():
                    dist.barrier(group=self.group)  # renamed into place before any rank goes on
            except BaseException as e:  # noqa: BLE001 - raised again by wait()
                self.error = e

        self.thread = threading.Thread(target=run, name="lightning_tp checkpoint writer", daemon=True)
        self.thread.start()

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> None:
        """Until the write in flight (if any) is in place; its error, if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"an asynchronous checkpoint write failed: {error}") from error


def is_sharded(path) -> bool:
    """A checkpoint directory this project wrote (any format)."""
    return kind(path) == "lightning_tp"


def kind(path) -> str | None:
    """``"lightning_tp"``, ``"lightning_dcp"`` (Lightning's FSDP / ModelParallelStrategy distributed checkpoint),
    ``"deepspeed"`` (a DeepSpeedStrategy checkpoint directory) or None."""
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / META).is_file():
        try:
            ours = "lightning_tp" in safe_load(path / META)  # both formats record their layout there
        except ValueError:  # Lightning's meta.pt may hold objects weights_only refuses; any other says so
            if not (path / dcp_io.INDEX).is_file() or _names_ours(dcp_io.read_index(path)):
                raise
            ours = False
        return "lightning_tp" if ours else "lightning_dcp" if (path / dcp_io.INDEX).is_file() else None
    if (path / "latest").is_file() or (path / "checkpoint").is_dir():
        return "deepspeed"
    return None


def _names_ours(index) -> bool:
    """The DCP index names tensors as this project does ("model/...", "extra/..."), not as Lightning does."""
    return any(name.startswith(("model/", "extra/")) for name in index.state_dict_metadata)


def read_meta(path) -> dict:
    """A checkpoint directory's ``meta.pt`` (trainer state, layout), read as tensors and plain data."""
    meta = safe_load(Path(path) / META) if (Path(path) / META).is_file() else {}
    if "lightning_tp" not in meta:
        raise ValueError(f"{path} is not a lightning_tp checkpoint directory (no {META} with its layout in it).")
    return meta


def load(path, mesh, module, optimizers, device) -> dict:
    """This rank's view of a checkpoint: trainer state, its own tensors loaded into ``module`` (any layout),
    and the optimizers' state dicts in this layout. A checkpoint refused on one rank is refused on all."""
    box = {}

    def check():
        meta = read_meta(path)
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
    meta = read_meta(path)
    if meta["lightning_tp"].get("format", 1) < layout_free.FORMAT:
        return legacy.consolidate(path, meta, safe_load)
    index = dcp_io.read_index(path)
    dcp_io.check_complete(path, index)
    names = [n for n in index.state_dict_metadata if n.startswith("model/")]
    return {n[len("model/"):]: t for n, t in dcp_io.read_whole(path, index, names).items()}
