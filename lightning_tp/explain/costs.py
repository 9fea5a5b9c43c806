"""What each planned module costs, for :func:`lightning_tp.explain.explain`: TP collectives and saved
activations per token, and what T5's stacks add to a pipeline message. See docs/design/explain.md."""

from __future__ import annotations

import math
from collections import defaultdict

from torch import nn

from ..layers.shard import padded_size
from ..plans.hf_seq2seq import layout_of as seq2seq_layout

_ACTIVATIONS = ("torch.nn.modules.activation", "transformers.activations")


def _io(m: nn.Module):
    """(in, out) features of a Linear, or of a Hugging Face Conv1D (weight stored in x out); else None."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    if type(m).__name__ == "Conv1D" and hasattr(m, "nf"):
        return tuple(m.weight.shape)
    return None


def t5_head_counts(model) -> int | None:
    """The attention heads of a Hugging Face encoder-decoder of T5's layout, else None."""
    found = seq2seq_layout(model)
    if found is None or found[2] != "t5":
        return None
    return model.get_submodule(found[0])[0].layer[0].SelfAttention.n_heads


def t5_shares_its_bias(model) -> bool:
    """transformers 5's T5 under sdpa: blocks get one position bias for the whole batch and no masks."""
    import transformers

    config = next((m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")),
                  None)
    return int(transformers.__version__.split(".")[0]) >= 5 and getattr(config, "_attn_implementation", "") == "sdpa"


def t5_side(nxt: int, decoder_start: int, heads: int, T: int, grad: bool = False, shared: int = 0) -> float:
    """Elements per token a message to T5's block ``nxt`` holds besides the hidden states and the encoder's
    output (``grad``: in the gradient that comes back); ``shared``: transformers 5's T5 sends no masks
    (sdpa, unpadded) and one position bias for a microbatch of ``shared`` rows. See docs/design/explain.md."""
    bias = heads * T / (shared or 1)
    masks = 0 if shared else 1
    if grad:
        return 0 if nxt == decoder_start else bias
    if nxt < decoder_start:
        return masks + bias
    return masks * (T + 1) + (0 if nxt == decoder_start else 2 * bias)


def width_in(module: nn.Module) -> int:
    for m in module.modules():
        if isinstance(m, nn.MultiheadAttention):
            return m.embed_dim
        if _io(m):
            return _io(m)[0]
    return 0


def cost_entries(match):
    """(path, style, options): plan entries are (path, style) or (path, style, options)."""
    return [(e[0], e[1], e[2] if len(e) > 2 else {}) for e in match.entries]


def _enter(w, sp, tp):
    """(op, elements per token, pass) entering the TP region; _leave: leaving it."""
    return [("all_gather", w / tp, "fwd"), ("reduce_scatter", w, "bwd")] if sp else [("all_reduce", w, "bwd")]


def _leave(w, sp, tp):
    return [("reduce_scatter", w, "fwd"), ("all_gather", w / tp, "bwd")] if sp else [("all_reduce", w, "fwd")]


def _cross_attention(base, path: str) -> bool:
    """nn.TransformerDecoderLayer's attention over the encoder's output (query and memory enter apart)."""
    parent, _, leaf = path.rpartition(".")
    return leaf == "multihead_attn" and isinstance(base.get_submodule(parent), nn.TransformerDecoderLayer)


def tp_ops(base, matches, sp, tp, hidden, locate, locate_end):
    """TP collectives per location ("block", i) / ("first",) / ("last",), as (op, elements per
    token, pass), from the plan entries; and {path: (style, sp on, options)}. ``locate_end``: where a
    module's output is made (an encoder stack's: at its last block), for an sp_end."""
    ops, style_of = defaultdict(list), {}
    for mt in matches:
        msp = sp and mt.sp_start is not None
        styles = {s for _, s, _ in cost_entries(mt)}
        for path, style, options in cost_entries(mt):
            esp = msp and not options.get("full_input")
            style_of[path] = (style, esp, options)
            mod, loc = base.get_submodule(path), locate(path)
            if style in ("region", "colwise", "lm_head", "mha"):  # inputs whole under SP enter by copy
                ops[loc] += _enter(width_in(mod), esp, tp)
                ops[loc] += _enter(width_in(mod), esp and not options.get("whole_inputs"), tp) * \
                    len(options.get("inputs", ()))
            if style == "mha" and _cross_attention(base, path):  # the encoder's output enters too (whole: a copy)
                ops[loc] += _enter(width_in(mod), esp and not options.get("whole_inputs"), tp)
            if style in ("rowwise", "mha"):
                ops[loc] += _leave(_io(mod)[1] if _io(mod) else getattr(mod, "embed_dim", None) or mod.embedding_dim,
                                   esp, tp)
            if style == "vocab":
                ops[loc].append(("all_reduce", mod.embedding_dim, "fwd"))
            if style == "lm_head" and not options.get("return_shards"):  # the logits the model returns
                ops[loc].append(("all_gather", padded_size(_io(mod)[1], tp) / tp, "fwd"))
            if style == "vocab_ce" and "lm_head" in styles:
                ops[loc] += [("all_reduce", 1, "fwd"), ("all_reduce", 2, "fwd")]
        for start in mt.sp_starts() if msp else ():  # the split's backward, at each sequence's start
            ops[locate(start)].append(("all_gather", hidden / tp, "bwd"))
        for end in mt.sp_ends() if msp else ():
            ops[locate_end(end)].append(("all_gather", hidden / tp, "fwd"))
    return ops, style_of


def saved_widths(base, style_of, tp, locate, fused: bool = True, sp_starts=()):
    """Elements per token saved for backward on one tp rank, per location (see docs/design/explain.md);
    ``fused``: attention cores run SDPA's fused kernels (which keep a log-sum-exp per head); ``sp_starts``:
    the modules given sequence shards under SP."""
    width, skip, last_out = defaultdict(float), None, 0
    for name, mod in base.named_modules():
        if skip and name.startswith(skip):
            continue
        if name in sp_starts:
            last_out /= tp
        (st, msp, _), loc, io = style_of.get(name, (None, False, {})), locate(name) if name else ("first",), _io(mod)
        if st in ("region", "mha"):
            inner = [n for n, c in mod.named_modules(prefix=name) if _io(c)]
            rows = [_io(base.get_submodule(n))[0] for n in inner if style_of.get(n, ("",))[0] == "rowwise"]
            qkv = sum(style_of[n][2].get("chunks", 1) for n in inner if style_of.get(n, ("",))[0] == "colwise_local")
            a = rows[0] if rows else width_in(mod)
            attention = st == "mha" or qkv >= 3  # q, k, v: attention (not a gated MLP)
            # the input, and the core's q, k, v (its output is the row-parallel projection's input, counted there)
            width[loc] += width_in(mod) + (3 * a / tp if attention else 0) + (a / tp if st == "mha" else 0)
            if attention and fused:
                width[loc] += heads_of(mod, 0) / tp  # a log-sum-exp per head and token
            if st == "mha":
                skip, last_out = name + ".", mod.embed_dim
        elif io:
            width[loc] += {"colwise_local": 0, "rowwise": io[0] / tp}.get(st, io[0])
            last_out = _out_per_rank(st, msp, io, tp)
        elif "Norm" in type(mod).__name__:
            width[loc] += _norm_width(mod, st, msp, tp) + _norm_statistics(mod) / (tp if st == "sp_norm" and msp else 1)
        elif type(mod).__module__ in _ACTIVATIONS or isinstance(mod, nn.modules.loss._Loss):
            width[loc] += last_out
        elif isinstance(mod, nn.Dropout) and mod.p > 0:  # its mask, in the activations' dtype (CPU)
            width[loc] += last_out
        elif isinstance(mod, nn.Embedding):  # its output, whole on every tp rank (a vocab-parallel one's summed)
            last_out = mod.embedding_dim
    return width


def _norm_statistics(mod) -> int:
    """Per-token statistics a norm keeps for its backward: LayerNorm's mean and 1/std, RMSNorm's 1/rms."""
    return 2 if isinstance(mod, nn.LayerNorm) else 1 if isinstance(mod, getattr(nn, "RMSNorm", ())) else 0


def saved_scores(base, style_of, tp, locate, seq: int, copies: int):
    """Elements per token each location's attention cores keep as s x s tensors: ``copies`` per head
    (0 for SDPA's fused kernels) x heads / tp x the sequence length (see docs/design/explain.md)."""
    scores = defaultdict(float)
    for name, mod in base.named_modules():
        st = style_of.get(name, (None,))[0]
        if copies and st in ("region", "mha") and _attention(mod, name, style_of):
            scores[locate(name)] += copies * heads_of(mod) / tp * seq
    return scores


def _attention(mod, name, style_of) -> bool:
    if style_of[name][0] == "mha":
        return True
    inner = [n for n, c in mod.named_modules(prefix=name) if _io(c)]
    return sum(style_of[n][2].get("chunks", 1) for n in inner if style_of.get(n, ("",))[0] == "colwise_local") >= 3


def heads_of(mod, default=None) -> int:
    for attr in ("num_heads", "n_head", "n_heads", "num_attention_heads"):
        if isinstance(getattr(mod, attr, None), int):
            return getattr(mod, attr)
    config = getattr(mod, "config", None)  # Hugging Face attention modules
    if isinstance(getattr(config, "num_attention_heads", None), int):
        return config.num_attention_heads
    if default is not None:
        return default
    raise ValueError(f"explain(score_copies=...): {type(mod).__name__} has no head count (num_heads, n_head).")


def weight_grad_widths(base, style_of, tp, locate):
    """Elements per token, per location, of the gradients ZB-H1's B keeps for W to start from: each
    weight op's output gradient (a Linear's output on this tp rank, a norm's width)."""
    width = defaultdict(float)
    for name, mod in base.named_modules():
        if not name:
            continue
        (st, msp, _), io = style_of.get(name, (None, False, {})), _io(mod)
        if io and any(p.requires_grad for p in mod.parameters(recurse=False)):
            width[locate(name)] += _out_per_rank(st, msp, io, tp)
        elif "Norm" in type(mod).__name__ and getattr(mod, "weight", None) is not None:
            width[locate(name)] += _norm_width(mod, st, msp, tp)
    return width


def _out_per_rank(st, msp, io, tp):
    """A Linear's output features on one tp rank, by its style (the head's vocabulary padded)."""
    out = padded_size(io[1], tp) if st == "lm_head" else io[1]
    return out / tp if st in ("colwise", "colwise_local", "lm_head") or (st == "rowwise" and msp) else out


def _norm_width(mod, st, msp, tp):
    """A norm's width on one tp rank (split under SP)."""
    shape = getattr(mod, "normalized_shape", None) or getattr(getattr(mod, "weight", None), "shape", ())
    return math.prod(shape) / (tp if st == "sp_norm" and msp else 1) if shape else 0
