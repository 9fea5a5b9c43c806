"""What tp must divide in a plan: the sizes of the modules it styles (whole heads per rank, or key/value
heads copied) and the attributes its rules divide. Checked by :func:`.apply.resolve` on every rank
before any collective; the attribute values are set by :func:`.apply.apply`."""

from __future__ import annotations

import copy

from torch import nn

from ..layers.linear import is_conv1d
from ..layers.shard import check_divisible
from .base import parse_rule


def _pieces(module: nn.Module, options: dict) -> list:
    """Output sizes of the pieces a colwise weight is split into (sections, or equal chunks)."""
    total = module.weight.shape[1 if is_conv1d(module) else 0]
    chunks = options.get("chunks", 1)
    return list(options.get("sections") or [total // chunks] * chunks)


def _replicable(options: dict, n: int) -> set:
    flag = options.get("replicate_heads", False)
    return set(range(n)) if flag is True else set(flag or ())


def head_replicas(module: nn.Module, options: dict, tp: int) -> tuple:
    """Per piece, how many ranks share each slice: tp // heads for key/value heads that tp exceeds,
    else 1. () when nothing is replicated. Sizes were checked by :func:`check_sizes`."""
    sizes, unit = _pieces(module, options), options.get("unit", 1)
    kv = _replicable(options, len(sizes))
    reps = tuple(tp // (s // unit) if i in kv and s // unit < tp else 1 for i, s in enumerate(sizes))
    return reps if any(r > 1 for r in reps) else ()


def check_sizes(name: str, module: nn.Module, style: str, tp: int, options: dict) -> None:
    hint = "Use sizes divisible by tp, or a tp that divides them."
    conv = is_conv1d(module)
    if style in ("colwise", "colwise_local"):
        sizes, unit = _pieces(module, options), options.get("unit", 1)
        kv = _replicable(options, len(sizes))
        if kv and unit <= 1:
            raise ValueError(f"{name}: 'replicate_heads' needs 'unit' (the head size) to count the heads.")
        for i, out in enumerate(sizes):
            heads = out // unit if unit > 1 and out % unit == 0 else 0
            if heads and heads % tp:
                if i in kv and tp % heads == 0:
                    continue  # each key/value head is copied to tp // heads ranks
                if i in kv:
                    raise ValueError(f"{name}: out_features = {out} holds {heads} key/value heads of {unit}; tp = {tp} "
                                     f"neither splits them into whole heads nor copies each to the same number of "
                                     f"ranks. Use a tp that divides {heads} or is a multiple of it.")
                raise ValueError(f"{name}: out_features = {out} holds {heads} heads of {unit}, which tp = {tp} "
                                 f"cannot split into whole heads. Use a tp dividing {heads}.")
            check_divisible("out_features", name, out, tp, hint)
    elif style == "rowwise":
        check_divisible("in_features", name, module.weight.shape[0 if conv else 1], tp, hint)
    elif style == "mha":
        check_divisible("num_heads", name, module.num_heads, tp, hint)
    elif style == "embedding_cols":
        check_divisible("embedding_dim", name, module.embedding_dim, tp, hint)


def getattr_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_attr(name: str, attr: str, value: int, rule: str, tp: int) -> None:
    kind, n_kv = parse_rule(rule)
    if kind == "divide":
        check_divisible(attr, name, value, tp, f"Set {attr} to a multiple of {tp}, or use a tp that divides it.")
    elif kind == "kv_heads" and value % tp and tp % value:
        raise ValueError(f"{name}: {attr} = {value} key/value heads; tp = {tp} neither divides it nor is a multiple "
                         f"of it. Use a tp that divides {value} or is a multiple of it.")
    elif kind == "kv_groups" and n_kv % tp and (tp % n_kv or value % (tp // n_kv)):
        raise ValueError(f"{name}: {attr} = {value} query heads per key/value head ({n_kv} kv heads) cannot be "
                         f"split over tp = {tp}. Use a tp that divides {n_kv}, or a multiple of {n_kv} that divides "
                         f"the {value * n_kv} query heads.")


def _rule_value(value: int, rule: str, tp: int) -> int:
    kind, n_kv = parse_rule(rule)
    if kind == "divide":
        return value // tp
    if kind == "kv_heads":
        return max(1, value // tp)  # fewer heads than ranks: one (replicated) head each
    return value // (tp // n_kv) if tp > n_kv else value  # kv_groups: this rank's q heads share one kv head


def set_attrs(module: nn.Module, rules: dict, tp: int) -> None:
    """Apply each attr rule; a dotted path first gives the module its own copy of each shared holder."""
    copied = {}
    for attr, rule in rules.items():
        *holders, leaf = attr.split(".")
        obj = module
        for i, part in enumerate(holders):
            key = ".".join(holders[: i + 1])
            if key not in copied:
                copied[key] = copy.copy(getattr(obj, part))
                setattr(obj, part, copied[key])
            obj = copied[key]
        setattr(obj, leaf, _rule_value(getattr(obj, leaf), rule, tp))
