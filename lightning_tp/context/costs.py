"""What explain counts for cp: the ring's bytes per rank and step, from each attention module's key and
value widths (K/V forward, again in backward and in a recompute, dK/dV back in fp32)."""

from __future__ import annotations

from torch import nn

KEY_NAMES, VALUE_NAMES = ("k_proj", "key", "k", "wk", "to_k"), ("v_proj", "value", "v", "wv", "to_v")
QUERY_NAMES = ("q_proj", "query", "q", "wq", "to_q")
FUSED_NAMES = ("c_attn", "qkv_proj", "query_key_value", "qkv", "Wqkv", "in_proj")


def _out_features(m: nn.Module) -> int:
    if isinstance(m, nn.Linear) or hasattr(m, "out_features"):
        return int(m.out_features)
    return int(getattr(m, "nf", 0))  # Hugging Face's Conv1D


def kv_width(attention: nn.Module, tp: int = 1) -> int:
    """Key plus value features per token this rank's attention module passes to SDPA (0 if not found)."""
    if isinstance(attention, nn.MultiheadAttention):
        return 2 * attention.embed_dim // tp
    k = v = fused = 0
    for name, m in attention.named_modules():
        leaf = name.rpartition(".")[2]
        k += _out_features(m) if leaf in KEY_NAMES else 0
        v += _out_features(m) if leaf in VALUE_NAMES else 0
        fused += _out_features(m) if leaf in FUSED_NAMES else 0
    if k and v:
        return (k + v) // tp
    return 2 * fused // 3 // tp  # [q | k | v] of equal widths


def q_width(attention: nn.Module, tp: int = 1) -> int:
    """Query features per token this rank's attention module passes to SDPA (0 if not found)."""
    if isinstance(attention, nn.MultiheadAttention):
        return attention.embed_dim // tp
    q = sum(_out_features(m) for n, m in attention.named_modules() if n.rpartition(".")[2] in QUERY_NAMES)
    return q // tp if q else kv_width(attention, tp) // 2


def ring_flop_per_byte(model: nn.Module, config, seq_len: int, dtype_bytes: int) -> float:
    """Attention FLOPs a rank computes per byte it sends in one ring step (the lowest over attention modules and
    forward/backward): a step's two c x c blocks beside its K/V (backward: 2.5x the FLOPs, K/V plus dK/dV in fp32)."""
    c, found = seq_len // (2 * config.cp), []
    for _, m in attention_modules(model):
        q, kv = q_width(m, config.tp), kv_width(m, config.tp)
        if q and kv:
            flops, sent = 8 * c * c * q, 2 * c * kv
            found.append(min(flops / (sent * dtype_bytes), 2.5 * flops / (sent * (dtype_bytes + 4))))
    return min(found) if found else 0.0


def attention_modules(model: nn.Module) -> list:
    """(path, module) of the innermost modules whose class name says attention, and nn.MultiheadAttention."""
    found = [(n, m) for n, m in model.named_modules()
             if isinstance(m, nn.MultiheadAttention) or "attention" in type(m).__name__.lower()]
    return [(n, m) for n, m in found if not any(o is not m and any(c is o for c in m.modules()) for _, o in found)]


def ring_bytes(model: nn.Module, runs, config, tokens: int, dtype_bytes: int) -> int:
    """Bytes one rank sends around the ring per optimizer step; ``runs(path)``: how often this rank runs
    the module per microbatch; ``tokens``: this rank's tokens per step (all microbatches)."""
    cp, recomputed = config.cp, 1 if (config.activation_checkpointing or config.selective) else 0
    if config.cp_attention == "all_to_all":
        return 0  # counted with the all-to-alls (not modelled yet)
    total = 0
    for path, m in attention_modules(model):
        kv = kv_width(m, config.tp) * runs(path)
        total += tokens * kv * ((cp - 1) * dtype_bytes * (2 + recomputed) + cp * 4)
    return total
