"""Checkpoints of the first format (one file per model-parallel rank, ``model_tp{t}_pp{p}[_ep{e}].pt``):
still loaded, under the layout that wrote them, and consolidated."""

from __future__ import annotations

from pathlib import Path

from ..layers.shard import ShardSpec, unshard


def shard_file(tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
    """A shard's file name; expert-parallel ranks past the first hold other experts (``_ep{n}``)."""
    return f"model_tp{tp_rank}_pp{pp_rank}" + (f"_ep{ep_rank}" if ep_rank else "") + ".pt"


def load(path, meta: dict, mesh, safe_load) -> dict:
    """This rank's view: trainer state plus its own shard (the layout must be the one that wrote it)."""
    path = Path(path)
    layout = meta.get("lightning_tp", {})
    if (layout.get("tp"), layout.get("pp"), layout.get("ep", 1)) != (mesh.tp, mesh.pp, mesh.ep):
        raise ValueError(
            f"checkpoint {path} is in lightning_tp's first format, which resumes only under the layout that wrote "
            f"it: tp={layout.get('tp')}, pp={layout.get('pp')}, ep={layout.get('ep', 1)}, but this run has "
            f"tp={mesh.tp}, pp={mesh.pp}, ep={mesh.ep}. Resume it with that layout and save again (checkpoints "
            f"written now move between layouts), or turn it into plain weights with "
            f"lightning_tp.consolidate({str(path)!r}).")
    shard = safe_load(path / shard_file(mesh.tp_rank, mesh.pp_rank, mesh.ep_rank))
    shard.pop("specs", None)
    meta.update(shard.pop("rest", {}))  # this rank's own (dp rank 0's, as DDP keeps rank 0's)
    meta.update(shard)
    return meta


def consolidate(path, meta: dict, safe_load) -> dict:
    """Merge the shard files into the single-device module's state_dict."""
    path = Path(path)
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
