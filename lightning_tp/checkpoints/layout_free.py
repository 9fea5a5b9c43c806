"""Checkpoints any layout can resume: the model, the optimizer state and the callbacks' model copies as
chunks of the single-device tensors (DCP), the trainer state in ``meta.pt``. Each rank writes and reads
only its own chunks. See docs/checkpoints.md and docs/design/checkpoints-internals.md."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layers.shard import spec_of
from ..dp.zero.local_shards import is_sharded, local, local_range
from . import dcp_io
from .chunks import Chunk, Chunked, chunks_of, flat_chunks_of, full_shape

FORMAT = 2
ZERO_SLICES = "lightning_tp_zero_slices"  # an optimizer state given as a zero=1 optimizer's own slices


def _specs(module) -> dict:
    return {n: spec_of(p) for n, p in module.named_parameters(remove_duplicate=False)}


def _names(module) -> dict:
    """id(parameter) -> its state-dict names (a tied weight has several)."""
    out: dict = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def state_order(optimizer) -> list:
    """The optimizer's parameters, group by group, in its state dict's order (zero=1's as the user gave them)."""
    zero = getattr(optimizer, "_lightning_tp_zero", None)
    return zero.original if zero is not None else [list(g["params"]) for g in optimizer.param_groups]


def _model_like(value, keys) -> bool:
    return isinstance(value, dict) and bool(value) and all(k in keys and torch.is_tensor(v) for k, v in value.items())


def _like(value, param) -> bool:
    return torch.is_tensor(value) and value.shape == param.shape


def _chunks(t: torch.Tensor, spec, tp_rank: int) -> Chunked:
    """``chunks_of``, also for a zero=3 DTensor: its local shard, a run of whole rows of the tp-local tensor."""
    if is_sharded(t):
        return flat_chunks_of(local(t).reshape(-1), tuple(t.shape), spec, tp_rank, local_range(t)[0])
    return chunks_of(t, spec, tp_rank)


def _dtensor_zeros(q, dtype):
    """Zeros shaped and sharded like the zero=3 parameter ``q`` (a DTensor), on the CPU."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(torch.zeros(local(q).shape, dtype=dtype), q.device_mesh, q.placements,
                              run_check=False, shape=q.shape, stride=q.stride())


def _whole(t: torch.Tensor) -> Chunked:
    return Chunked(tuple(t.shape), [Chunk((0,) * t.dim(), t)])


def tensors_to_save(checkpoint: dict, module, optimizers, tp_rank: int):
    """(``{name: Chunked}``, plain description) of what this rank writes."""
    specs, names = _specs(module), _names(module)
    keys = set(module.state_dict().keys())
    out, model_like = {}, [k for k, v in checkpoint.items() if k != "state_dict" and _model_like(v, keys)]
    for entry in ["state_dict"] + model_like:
        prefix = "model/" if entry == "state_dict" else f"extra/{entry}/"
        for k, t in checkpoint.get(entry, {}).items():
            out[prefix + k] = _chunks(t.detach(), specs.get(k), tp_rank)
    described = [_optimizer_to_save(i, opt, sd, names, tp_rank, out)
                 for i, (opt, sd) in enumerate(zip(optimizers, checkpoint.get("optimizer_states", [])))]
    return out, {"model_like": model_like, "optimizers": described}


def _slices(opt) -> dict:
    """id(what a zero=1 optimizer steps) -> (the whole parameter, where the slice starts in it); whole
    parameters (not bucketed) map to themselves."""
    zero = getattr(opt, "_lightning_tp_zero", None)
    out = {id(p): (p, None) for g in opt.param_groups for p in g["params"]}
    if zero is not None:
        out.update({id(s.param): (b.params[s.index], s.part.start) for b in zero.buckets for s in b.slices})
    return out


def _optimizer_to_save(i: int, opt, sd: dict, names: dict, tp_rank: int, out: dict) -> dict:
    """Put optimizer ``i``'s state tensors into ``out`` under its weights' names; returns its description. A
    zero=1 optimizer's (``sd`` only says so) is this rank's slices, read from the optimizer: nothing gathered."""
    if sd.get(ZERO_SLICES):
        sliced = _slices(opt)
        entries = [(*sliced[id(p)], opt.state.get(p, {})) for g in opt.param_groups for p in g["params"]]
        hyper = opt.param_groups
    else:
        params = [p for group in state_order(opt) for p in group]
        entries = [(params[j], None, state) for j, state in sd["state"].items()]
        hyper = sd["param_groups"]
    plain = {}
    for q, start, state in entries:
        for n in names[id(q)]:  # under every name, so a layout holding the weight under another finds it
            for key, v in state.items():
                name = f"optim{i}/{n}/{key}"
                if torch.is_tensor(v) and v.dim() > 0 and start is not None:  # a zero=1 slice of the moments
                    out[name] = flat_chunks_of(v.detach().reshape(-1), tuple(q.shape), spec_of(q), tp_rank, start)
                elif _like(v, q):
                    out[name] = _chunks(v.detach(), spec_of(q), tp_rank)
                elif torch.is_tensor(v) and (v.dim() == 0 or spec_of(q) is None):
                    out[name] = _whole(v.detach())
                elif torch.is_tensor(v):  # shaped otherwise on a sharded weight: only this layout reads it
                    out[f"{name}@tp{tp_rank}"] = _whole(v.detach())
                else:
                    plain.setdefault(n, {})[key] = v
    where = {n: g for g, group in enumerate(state_order(opt)) for p in group for n in names.get(id(p), [])}
    return {"groups": [{k: v for k, v in g.items() if k != "params"} for g in hyper], "group_of": where,
            "plain": plain}


def merge_descriptions(parts: list) -> dict:
    """Every rank's description (different stages hold different weights) as one."""
    out = {"model_like": parts[0]["model_like"], "optimizers": []}
    for i in range(len(parts[0]["optimizers"])):
        mine = [p["optimizers"][i] for p in parts if i < len(p["optimizers"])]
        merged = {"groups": [], "group_of": {}, "plain": {}}
        for m in mine:
            merged["group_of"].update(m["group_of"])
            merged["plain"].update(m["plain"])
            if len(m["groups"]) > len(merged["groups"]):
                merged["groups"] = m["groups"]
        out["optimizers"].append(merged)
    return out


def gather_descriptions(description: dict) -> dict:
    if not dist.is_initialized():
        return merge_descriptions([description])
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, description)
    return merge_descriptions(parts)


def _check_model(path, index, module, specs) -> dict:
    """The module's state dict, every tensor of it checked against the checkpoint's names and shapes."""
    state = module.state_dict()
    for k, t in state.items():
        meta = index.state_dict_metadata.get("model/" + k)
        if meta is None:
            raise ValueError(f"checkpoint {path} has no tensor '{k}', which the module has: it was saved from another "
                             f"model.")
        want = full_shape(t, specs.get(k))
        if tuple(meta.size) != want:
            raise ValueError(f"checkpoint {path}: '{k}' has shape {tuple(meta.size)} there but {want} in the module.")
    return state


def _optimizer_targets(path, index, keys_of, i, opt, names, saved: dict, tp_rank: int, targets: dict) -> dict:
    """The optimizer's state dict in this layout's indices, its tensors to be filled through ``targets``; a
    zero=1 optimizer's in its slices' (it loads that as it is). ``keys_of``: 'optim<i>/<weight>/' -> its saved keys."""
    zero = getattr(opt, "_lightning_tp_zero", None)
    order = state_order(opt)
    if len(saved["groups"]) != len(order):
        raise ValueError(f"checkpoint {path}: optimizer {i} had {len(saved['groups'])} parameter groups, this one "
                         f"has {len(order)} (configure_optimizers must build the same groups).")
    stored, sliced = index.state_dict_metadata, _slices(opt)
    steps = [list(g["params"]) for g in opt.param_groups] if zero is not None else order
    state, j = {}, 0
    for group in steps:
        for p in group:
            q, start = sliced[id(p)]
            for n in names.get(id(q), []):
                prefix = f"optim{i}/{n}/"
                keys = keys_of.get(prefix, [])
                if not keys and n not in saved["plain"]:
                    continue
                entry = dict(saved["plain"].get(n, {}))
                for key in keys:
                    meta, target = stored[prefix + key], prefix + key
                    if "@tp" in key:  # shaped unlike its sharded weight: this tp rank's own
                        key, rank = key.rsplit("@tp", 1)
                        if int(rank) != tp_rank:
                            continue
                    per_element = "@tp" not in target and tuple(meta.size) == full_shape(q, spec_of(q)) and q.dim() > 0
                    if per_element and start is not None:
                        v = torch.zeros(p.numel(), dtype=meta.properties.dtype)
                        targets[target] = flat_chunks_of(v, tuple(q.shape), spec_of(q), tp_rank, start)
                    elif per_element and is_sharded(q):  # zero=3: this rank's shard of it, as a DTensor
                        v = _dtensor_zeros(q, meta.properties.dtype)
                        targets[target] = _chunks(v, spec_of(q), tp_rank)
                    elif per_element:
                        v = torch.zeros(q.shape, dtype=meta.properties.dtype)
                        targets[target] = chunks_of(v, spec_of(q), tp_rank)
                    else:
                        v = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
                        targets[target] = _whole(v)
                    entry[key] = v
                state[j] = entry
                break
            j += 1
    groups, start = [], 0
    for hyper, group in zip(saved["groups"], steps):
        groups.append(dict(hyper, params=list(range(start, start + len(group)))))
        start += len(group)
    return {"state": state, "param_groups": groups, **({ZERO_SLICES: True} if zero is not None else {})}


def _check_layout_bound(path, index, layout: dict, tp: int) -> None:
    bound = sorted(k for k in index.state_dict_metadata if "@tp" in k)
    if bound and layout.get("tp") != tp:
        raise ValueError(f"checkpoint {path}: optimizer state {bound[0].split('@')[0]!r} is shaped unlike its sharded "
                         f"weight, so only tp={layout.get('tp')} can resume it (this run has tp={tp}).")


def prepare(path, meta: dict, module, optimizers, tp_rank: int, tp: int):
    """Check ``path`` against the module and this layout; (the views to fill, Lightning's checkpoint dict)."""
    index = dcp_io.read_index(path)
    dcp_io.check_complete(path, index)
    layout = meta.pop("lightning_tp")
    _check_layout_bound(path, index, layout, tp)
    specs, names = _specs(module), _names(module)
    state = _check_model(path, index, module, specs)
    targets = {"model/" + k: _chunks(t, specs.get(k), tp_rank) for k, t in state.items()}
    for entry in layout["model_like"]:
        meta[entry] = {k: torch.zeros_like(t) for k, t in state.items() if f"extra/{entry}/{k}" in
                       index.state_dict_metadata}
        targets.update({f"extra/{entry}/{k}": _chunks(t, specs.get(k), tp_rank) for k, t in meta[entry].items()})
    if len(layout["optimizers"]) != len(optimizers):
        raise ValueError(f"checkpoint {path} holds {len(layout['optimizers'])} optimizers' state, configure_optimizers "
                         f"gave {len(optimizers)}.")
    keys_of: dict = {}  # the index's optimizer entries by weight, read once
    for name in index.state_dict_metadata:
        if name.startswith("optim"):
            prefix, _, key = name.rpartition("/")
            keys_of.setdefault(prefix + "/", []).append(key)
    meta["optimizer_states"] = [_optimizer_targets(path, index, keys_of, i, opt, names, saved, tp_rank, targets)
                                for i, (opt, saved) in enumerate(zip(optimizers, layout["optimizers"]))]
    meta["state_dict"] = state
    return (targets, index), meta


def fill(path, prepared) -> None:
    """Read the prepared views (collective: every rank calls it)."""
    targets, index = prepared
    dcp_io.load(targets, path, index)
