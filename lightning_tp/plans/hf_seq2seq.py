"""Plans for Hugging Face encoder-decoders (BART's and T5's layouts), built from the model's own layers.
See docs/design/plans.md."""

from __future__ import annotations

import inspect

from torch import nn

from ..pipeline.cut.encoder_decoder import find_encoder_decoder
from .base import Plan
from .hf import call_getter, holds, path_of


def _kv_input(attention: nn.Module):
    """The name under which a cross-attention takes the encoder's output (T5 and BART:
    ``key_value_states``; UMT5: ``encoder_hidden_states``), or None."""
    params = inspect.signature(attention.forward).parameters
    return next((n for n in ("key_value_states", "encoder_hidden_states") if n in params), None)


def layout_of(module: nn.Module):
    """(encoder path, decoder path, "bart" | "t5", the cross-attention's input name) or None: a
    layout seen in part (FSMT's attention) does not match."""
    lists = find_encoder_decoder(module)
    if lists is None:
        return None
    enc, dec = (module.get_submodule(p)[0] for p in lists)
    if holds(enc, "self_attn.q_proj", "fc1", "fc2") and holds(dec, "self_attn.q_proj", "encoder_attn.q_proj", "fc1"):
        kind, cross = "bart", dec.encoder_attn
    elif holds(enc, "layer.0.SelfAttention.q") and _t5_mlp(enc) is not None \
            and holds(dec, "layer.0.SelfAttention.q", "layer.1.EncDecAttention.q"):
        kind, cross = "t5", dec.layer[1].EncDecAttention
    else:
        return None
    kv = _kv_input(cross)
    return (*lists, kind, kv) if kv is not None else None


def _t5_mlp(block: nn.Module):
    """The name of a T5-layout block's MLP in its last sub-layer: T5's ``DenseReluDense``, or Switch
    Transformers' ``mlp`` (dense, or a sparse one of experts, left to expert parallelism); else None."""
    last = getattr(block, "layer", [None])[-1]
    return next((n for n in ("DenseReluDense", "mlp") if isinstance(getattr(last, n, None), nn.Module)), None)


def _is_norm(m: nn.Module) -> bool:
    return type(m).__name__.endswith(("Norm", "LayerNorm", "RMSNorm"))


def _norms(module: nn.Module, path: str) -> dict:
    """Styles of the norms of block list ``path``'s blocks and of its stack (the list's parent): 'sp_norm'
    where they run on sequence shards, inside the blocks and after them; 'replicate' before them (a norm
    of the embeddings)."""
    stack_path = path.rpartition(".")[0]
    stack = module.get_submodule(stack_path) if stack_path else module
    styles = {f"{path}.*.{_glob_indices(name)}": "sp_norm"
              for name, m in module.get_submodule(path)[0].named_modules() if name and _is_norm(m)}
    for name, m in stack.named_children():
        if _is_norm(m):
            styles[f"{stack_path}.{name}" if stack_path else name] = "replicate" if "embed" in name else "sp_norm"
    return styles


def _glob_indices(name: str) -> str:
    """T5's ``layer.0.layer_norm``, ``layer.2.layer_norm``: one glob for every sub-layer's norm."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _bart(enc: str, dec: str, kv: str, module: nn.Module) -> tuple:
    styles, attrs = {}, {}
    for path in (enc, dec):
        head_dim = module.get_submodule(path)[0].self_attn.head_dim
        styles[f"{path}.*.self_attn"] = "region"  # q, k and v read the same hidden states
        styles.update({f"{path}.*.self_attn.{p}": {"style": "colwise_local", "unit": head_dim}
                       for p in ("q_proj", "k_proj", "v_proj")})
        styles[f"{path}.*.self_attn.out_proj"] = "rowwise"
        styles.update({f"{path}.*.fc1": "colwise", f"{path}.*.fc2": "rowwise"})
        attrs[f"{path}.*.self_attn"] = {"num_heads": "divide", "embed_dim": "divide"}
        styles.update(_norms(module, path))
    head_dim = module.get_submodule(dec)[0].encoder_attn.head_dim
    styles[f"{dec}.*.encoder_attn"] = {"style": "region", "inputs": [kv], "whole_inputs": True}
    styles.update({f"{dec}.*.encoder_attn.{p}": {"style": "colwise_local", "unit": head_dim}
                   for p in ("q_proj", "k_proj", "v_proj")})
    styles[f"{dec}.*.encoder_attn.out_proj"] = "rowwise"
    attrs[f"{dec}.*.encoder_attn"] = {"num_heads": "divide", "embed_dim": "divide"}
    return styles, attrs


def _t5(enc: str, dec: str, kv: str, module: nn.Module) -> tuple:
    styles, attrs = {}, {}
    for path in (enc, dec):
        block = module.get_submodule(path)[0]
        attn, unit = f"{path}.*.layer.0.SelfAttention", block.layer[0].SelfAttention.key_value_proj_dim
        styles[attn] = "region"
        styles.update({f"{attn}.{p}": {"style": "colwise_local", "unit": unit} for p in "qkv"})
        styles[f"{attn}.o"] = "rowwise"
        styles[f"{attn}.relative_attention_bias"] = "embedding_cols"  # one column per head
        attrs[attn] = {"n_heads": "divide", "inner_dim": "divide"}
        mlp = _t5_mlp(block)
        ff = f"{path}.*.layer.{len(block.layer) - 1}.{mlp}"
        for each in module.get_submodule(path):  # wi, or gated wi_0 and wi_1; wo (not in a block of experts)
            for name, _ in getattr(each.layer[-1], mlp).named_children():
                if name.startswith(("wi", "wo")):
                    styles[f"{ff}.{name}"] = "rowwise" if name == "wo" else "colwise"
        styles.update(_norms(module, path))
    cross = f"{dec}.*.layer.1.EncDecAttention"
    unit = module.get_submodule(dec)[0].layer[1].EncDecAttention.key_value_proj_dim
    styles[cross] = {"style": "region", "inputs": [kv], "whole_inputs": True}
    styles.update({f"{cross}.{p}": {"style": "colwise_local", "unit": unit} for p in "qkv"})
    styles[f"{cross}.o"] = "rowwise"
    attrs[cross] = {"n_heads": "divide", "inner_dim": "divide"}
    return styles, attrs


class HFSeq2SeqPlan:
    """Builds a Plan for a Hugging Face encoder-decoder of BART's or T5's layout (plan="auto")."""

    name = "hf_seq2seq"

    def matches(self, module: nn.Module) -> bool:
        return getattr(getattr(module, "config", None), "is_encoder_decoder", False) is True and \
            hasattr(module, "get_output_embeddings") and layout_of(module) is not None

    def build(self, module: nn.Module) -> Plan:
        enc, dec, kind, kv = layout_of(module)
        styles, attrs = (_bart if kind == "bart" else _t5)(enc, dec, kv, module)
        head = module.get_output_embeddings()
        for name in _token_embeddings(module, head):
            styles[name] = "vocab"
        if head is not None:  # the path resolve() visits: the first one a module is found under
            styles[path_of(module, head)] = "lm_head"
        stacks = tuple(path.rpartition(".")[0] for path in (enc, dec))  # each list's parent
        return Plan(name=f"hf_seq2seq_{kind}", styles=styles, attrs=attrs, blocks=(enc, dec),
                    sp_start=(f"{enc}.*", f"{dec}.*"), sp_end=stacks[0], outputs=stacks)


def _token_embeddings(module: nn.Module, head) -> list:
    """Paths of the embeddings looked up by token: the input embeddings of the model, its encoder and
    its decoder, and any Embedding sharing the head's weight (BART's ``shared`` and both stacks'
    ``embed_tokens``; a decoder's resized embedding tied to the head). Never positions."""
    found = set()
    for owner in (module, call_getter(module, "get_encoder"), call_getter(module, "get_decoder")):
        emb = call_getter(owner, "get_input_embeddings")
        if isinstance(emb, nn.Embedding):
            found.add(id(emb))
    tied = getattr(head, "weight", None)
    return [name for name, m in module.named_modules()
            if isinstance(m, nn.Embedding) and (id(m) in found or (tied is not None and m.weight is tied))]


PLANS = [HFSeq2SeqPlan()]
