"""Plain checkpoints in and out: a Lightning ``.ckpt``, state_dict or Hugging Face directory loaded into
this rank's shards; merged weights written by :func:`save_consolidated`. See docs/design/checkpoints-internals.md."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .files import META, consolidate, kind, safe_load
from . import dcp_io
from ..layers.shard import shard, spec_of


HF_FILES = ("model.safetensors", "pytorch_model.bin")


def _read_weights(file: Path) -> dict:
    if file.name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(file, map_location="cpu", weights_only=True)


def _read_hf_dir(path: Path) -> dict:
    """A save_pretrained directory: one weights file, or shards listed in ``<file>.index.json``
    (what ``max_shard_size`` writes for large models)."""
    for name in HF_FILES:
        if (path / name).is_file():
            return _read_weights(path / name)
    for name in HF_FILES:
        index = path / f"{name}.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
            if missing:
                raise ValueError(f"load_full={str(path)!r}: {index.name} lists {missing[:3]}, which are not in the "
                                 f"directory.")
            state = {}
            for file in sorted(set(weight_map.values())):
                state.update(_read_weights(path / file))
            return state
    raise ValueError(f"load_full={str(path)!r}: a directory, but none of {list(HF_FILES)} nor their sharded "
                     f"'.index.json' form is in it.")


def read_full_state_dict(path) -> dict:
    """The whole model's state_dict from a plain checkpoint, a Hugging Face directory, one of this project's
    checkpoint directories (merged by consolidate) or a Lightning FSDP / ModelParallelStrategy one."""
    path = Path(path)
    found = kind(path)
    if found == "lightning_tp":
        return consolidate(path)
    if found == "lightning_dcp":  # Lightning's FSDP / ModelParallelStrategy: the model's tensors, whole
        index = dcp_io.read_index(path)
        dcp_io.check_complete(path, index)
        names = dcp_io.lightning_model_names(index)
        return {names[n]: t for n, t in dcp_io.read_whole(path, index, list(names)).items()}
    if found == "deepspeed":
        raise ValueError(
            f"load_full={str(path)!r} is a DeepSpeed checkpoint directory. Its files are pickles only DeepSpeed's "
            f"own loader reads, and that runs code from them, which lightning_tp does not do on its own. If you "
            f"trust them, convert them once with Lightning's converter (pip install 'lightning-tp[deepspeed]'):\n"
            f"    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict\n"
            f"    convert_zero_checkpoint_to_fp32_state_dict({str(path)!r}, 'fp32.ckpt')\n"
            f"then pass load_full='fp32.ckpt'.")
    if path.is_dir():
        return _read_hf_dir(path)
    if path.name.endswith(".safetensors"):  # what `python -m lightning_tp export --to plain` writes
        return _read_weights(path)
    obj = safe_load(path)
    return obj["state_dict"] if isinstance(obj, dict) and "state_dict" in obj else obj


def _prefix(loaded: set, full_keys: list) -> str:
    """The prefix that maps the file's keys onto the module's (\"\" or e.g. \"model.\")."""
    candidates = {""} | {k[: -len(s)] for k in full_keys for s in loaded if k.endswith("." + s)}
    best = max(candidates, key=lambda p: sum(1 for k in loaded if p + k in full_keys))
    if not any(best + k in full_keys for k in loaded):
        raise ValueError("load_full: none of the checkpoint's keys match the module's parameters.")
    return best


def _keys_of(path) -> set:
    """The tensor names a plain checkpoint holds, read without its tensors where the format allows
    (safetensors headers, an index's weight map, torch.load with mmap); otherwise the file is read."""
    path = Path(path)
    if kind(path) is None and (path.is_file() or path.is_dir()):
        files = [path] if path.is_file() else [path / n for n in HF_FILES if (path / n).is_file()][:1]
        index = [path / f"{n}.index.json" for n in HF_FILES if (path / f"{n}.index.json").is_file()]
        if not files and index:
            return set(json.loads(index[0].read_text())["weight_map"])
        if files and files[0].name.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(files[0]), framework="pt") as f:
                return set(f.keys())
        if files:
            try:
                obj = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
            except (RuntimeError, ValueError):  # not the zip format mmap needs, or not a torch file
                obj = None
            if isinstance(obj, dict):
                return set(obj["state_dict"] if "state_dict" in obj else obj)
    return set(read_full_state_dict(path))


def check_full(path, full_keys: list) -> None:
    """load_full's checkpoint matched to the whole module's keys before any collective: every tensor the module
    holds must be in it, under its name or without the module's prefix (a tied head HF saves once excepted)."""
    loaded = _keys_of(path)
    prefix = _prefix(loaded, full_keys)
    missing = [k for k in full_keys if (k[len(prefix):] if k.startswith(prefix) else None) not in loaded
               and k not in loaded and not k.endswith("lm_head.weight")]
    if missing:
        raise ValueError(f"load_full={str(path)!r}: no tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''}.")


def load_full(module: torch.nn.Module, path, full_keys: list, tp_rank: int) -> list:
    """Copy a full checkpoint into this rank's (sharded, staged) module. Returns the keys it set."""
    loaded = read_full_state_dict(path)
    prefix = _prefix(set(loaded), full_keys)
    tensors = module.state_dict(keep_vars=True)  # persistent tensors only, tied names included
    done, missing = [], []
    for key, t in tensors.items():
        source = next((s for s in (key[len(prefix):] if key.startswith(prefix) else None, key) if s in loaded), None)
        if source is None:
            missing.append(key)
            continue
        full = loaded[source]
        spec = spec_of(t)
        with torch.no_grad():
            t.copy_(shard(full, spec, tp_rank) if spec is not None else full)
        done.append(key)
    tied_ok = [k for k in missing if k.endswith("lm_head.weight")]  # HF saves a tied head once
    missing = [k for k in missing if k not in tied_ok]
    if missing:
        raise ValueError(f"load_full={str(path)!r}: no tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''}.")
    return done


def save_consolidated(path, out) -> str:
    """Merge a sharded checkpoint directory into one Lightning checkpoint file at ``out``."""
    meta = safe_load(Path(path) / META)
    plain = {k: v for k, v in meta.items() if k in ("epoch", "global_step", "pytorch-lightning_version",
                                                   "hyper_parameters", "hparams_name", "datamodule_hyper_parameters")}
    plain["state_dict"] = consolidate(path)
    torch.save(plain, out)
    return str(out)
