"""Plain checkpoints in and out: what a single-device project already has, and what it can load.

In: a Lightning ``.ckpt`` (its ``state_dict``), a saved state_dict, or a Hugging Face
``save_pretrained`` directory. Keys are matched to the LightningModule's own keys, allowing for a
prefix (the HF model usually sits at ``self.model``); each rank copies in its stage's tensors and
cuts its tensor-parallel shard with the same ShardSpec the layers use.
Out: :func:`save_consolidated` writes a Lightning checkpoint with the merged weights, which the
original project loads with ``load_from_checkpoint`` or ``load_state_dict``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import META, consolidate
from .layers.shard import shard, spec_of


def read_full_state_dict(path) -> dict:
    path = Path(path)
    if path.is_dir():
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    return load_file(str(path / name))
                return torch.load(path / name, map_location="cpu", weights_only=True)
        raise ValueError(f"load_full={str(path)!r}: a directory, but no model.safetensors or pytorch_model.bin in "
                         f"it (sharded Hugging Face checkpoints are not supported yet).")
    obj = torch.load(path, map_location="cpu", weights_only=False)
    return obj["state_dict"] if isinstance(obj, dict) and "state_dict" in obj else obj


def _prefix(loaded: set, full_keys: list) -> str:
    """The prefix that maps the file's keys onto the module's (\"\" or e.g. \"model.\")."""
    candidates = {""} | {k[: -len(s)] for k in full_keys for s in loaded if k.endswith("." + s)}
    best = max(candidates, key=lambda p: sum(1 for k in loaded if p + k in full_keys))
    if not any(best + k in full_keys for k in loaded):
        raise ValueError("load_full: none of the checkpoint's keys match the module's parameters.")
    return best


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
    meta = torch.load(Path(path) / META, map_location="cpu", weights_only=False)
    plain = {k: v for k, v in meta.items() if k in ("epoch", "global_step", "pytorch-lightning_version",
                                                   "hyper_parameters", "hparams_name", "datamodule_hyper_parameters")}
    plain["state_dict"] = consolidate(path)
    torch.save(plain, out)
    return str(out)
