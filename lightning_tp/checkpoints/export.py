"""A checkpoint directory's weights written out tensor by tensor: a ``.safetensors`` file under the
LightningModule's names (``plain``), or a Hugging Face directory (``hf``: the inner model's names,
``model.safetensors`` and ``config.json``). One full tensor is in memory at a time."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

from . import dcp_io

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def write_safetensors(out, path, index, names: dict) -> int:
    """Write ``{saved name: written name}`` of checkpoint ``path`` to file ``out`` (safetensors), one tensor
    read at a time; returns the largest tensor's bytes."""
    header, offset, largest = {}, 0, 0
    for saved, written in names.items():
        meta = index.state_dict_metadata[saved]
        if meta.properties.dtype not in _DTYPES:
            raise ValueError(f"{saved}: dtype {meta.properties.dtype} has no safetensors name")
        size = torch.Size(meta.size).numel() * meta.properties.dtype.itemsize
        header[written] = {"dtype": _DTYPES[meta.properties.dtype], "shape": list(meta.size),
                           "data_offsets": [offset, offset + size]}
        offset, largest = offset + size, max(largest, size)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for saved in names:
            t = dcp_io.read_whole(path, index, [saved])[saved]
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)  # no copy
            del t
    return largest


def _model_names(index) -> list:
    return [n for n in index.state_dict_metadata if n.startswith("model/")]


def _prefix(keys: list) -> str:
    """The LightningModule attribute holding the Hugging Face model (``model.`` when it is ``self.model``)."""
    first = {k.split(".", 1)[0] for k in keys}
    return next(iter(first)) + "." if len(first) == 1 and all("." in k for k in keys) else ""


def export(ckpt, out, to: str = "plain", config=None, prefix: str | None = None) -> Path:
    """Write checkpoint directory ``ckpt``'s weights to ``out``: ``to="plain"`` a safetensors file of the
    LightningModule's state dict; ``to="hf"`` a directory ``from_pretrained`` loads (``config``: a Hugging
    Face config object, a ``config.json`` or a directory holding one; ``prefix``: the module's attribute)."""
    from .files import read_meta

    meta = read_meta(ckpt)
    if meta["lightning_tp"].get("format", 1) < 2:
        raise ValueError(f"{ckpt} is in lightning_tp's first format: resume it once with the layout that wrote it "
                         f"and save again, or use lightning_tp.save_consolidated.")
    index = dcp_io.read_index(ckpt)
    dcp_io.check_complete(ckpt, index)
    saved = _model_names(index)
    keys = [n[len("model/"):] for n in saved]
    out = Path(out)
    if to == "plain":
        write_safetensors(out, ckpt, index, dict(zip(saved, keys)))
        return out
    if to != "hf":
        raise ValueError(f"export to={to!r}: choose 'plain' or 'hf'.")
    if config is None:
        raise ValueError("export to='hf' needs the model's Hugging Face config (config=, or --config on the command "
                         "line): a config object, a config.json or a save_pretrained directory.")
    prefix = _prefix(keys) if prefix is None else prefix
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(out)
    else:
        source = Path(config) / "config.json" if Path(config).is_dir() else Path(config)
        shutil.copyfile(source, out / "config.json")
    write_safetensors(out / "model.safetensors", ckpt, index,
                      {s: k[len(prefix):] for s, k in zip(saved, keys) if k.startswith(prefix)})
    return out
