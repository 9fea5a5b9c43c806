"""Plans for Hugging Face encoder-decoders, built from the model's own layers.

Two layouts cover the families: BART's (BART, mBART, Marian, Pegasus, Whisper, ...: attention
``q_proj``/``k_proj``/``v_proj``/``out_proj``, MLP ``fc1``/``fc2``, cross-attention ``encoder_attn``)
and T5's (``q``/``k``/``v``/``o``, ``wi``/``wo`` or gated ``wi_0``/``wi_1``/``wo``, and a per-head
``relative_attention_bias`` embedding in the first block of each stack). Found by plan="auto" on a
model whose config says ``is_encoder_decoder`` and whose two block lists have one of these layouts.

Self-attention enters the TP region once for q/k/v (style 'region'); cross-attention's query reads
the decoder's hidden states and its key and value the encoder's output, so its region is entered by
both (option ``inputs``: ``key_value_states``), one backward all-reduce each, as Megatron's
cross-attention does with its query and fused key-value projections. The token embeddings are vocab-parallel (BART ties three embedding modules and
the head to one weight: it is sharded once), the head gathers the logits for the model's own loss.
No sequence parallelism (as for nn.Transformer): norms stay replicated.
"""

from __future__ import annotations

from torch import nn

from ..pipeline.encoder_decoder import find_encoder_decoder
from .base import Plan


def _has(module: nn.Module, *paths: str) -> bool:
    try:
        for path in paths:
            module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _layout(module: nn.Module):
    """(encoder path, decoder path, "bart" | "t5") or None."""
    lists = find_encoder_decoder(module)
    if lists is None:
        return None
    enc, dec = (module.get_submodule(p)[0] for p in lists)
    if _has(enc, "self_attn.q_proj", "fc1", "fc2") and _has(dec, "self_attn.q_proj", "encoder_attn.q_proj", "fc1"):
        return (*lists, "bart")
    if _has(enc, "layer.0.SelfAttention.q") and _has(dec, "layer.0.SelfAttention.q", "layer.1.EncDecAttention.q"):
        return (*lists, "t5")
    return None


def _bart(enc: str, dec: str, module: nn.Module) -> tuple:
    styles, attrs = {}, {}
    for path in (enc, dec):
        head_dim = module.get_submodule(path)[0].self_attn.head_dim
        styles[f"{path}.*.self_attn"] = "region"  # q, k and v read the same hidden states
        styles.update({f"{path}.*.self_attn.{p}": {"style": "colwise_local", "unit": head_dim}
                       for p in ("q_proj", "k_proj", "v_proj")})
        styles[f"{path}.*.self_attn.out_proj"] = "rowwise"
        styles.update({f"{path}.*.fc1": "colwise", f"{path}.*.fc2": "rowwise"})
        attrs[f"{path}.*.self_attn"] = {"num_heads": "divide", "embed_dim": "divide"}
    head_dim = module.get_submodule(dec)[0].encoder_attn.head_dim
    styles[f"{dec}.*.encoder_attn"] = {"style": "region", "inputs": ["key_value_states"]}
    styles.update({f"{dec}.*.encoder_attn.{p}": {"style": "colwise_local", "unit": head_dim}
                   for p in ("q_proj", "k_proj", "v_proj")})
    styles[f"{dec}.*.encoder_attn.out_proj"] = "rowwise"
    attrs[f"{dec}.*.encoder_attn"] = {"num_heads": "divide", "embed_dim": "divide"}
    return styles, attrs


def _t5(enc: str, dec: str, module: nn.Module) -> tuple:
    styles, attrs = {}, {}
    for path in (enc, dec):
        block = module.get_submodule(path)[0]
        attn, unit = f"{path}.*.layer.0.SelfAttention", block.layer[0].SelfAttention.key_value_proj_dim
        styles[attn] = "region"
        styles.update({f"{attn}.{p}": {"style": "colwise_local", "unit": unit} for p in "qkv"})
        styles[f"{attn}.o"] = "rowwise"
        styles[f"{attn}.relative_attention_bias"] = "embedding_cols"  # one column per head
        attrs[attn] = {"n_heads": "divide", "inner_dim": "divide"}
        ff = f"{path}.*.layer.{len(block.layer) - 1}.DenseReluDense"
        for name, _ in block.layer[-1].DenseReluDense.named_children():  # wi, or gated wi_0 and wi_1; wo
            if name.startswith(("wi", "wo")):
                styles[f"{ff}.{name}"] = "rowwise" if name == "wo" else "colwise"
    cross = f"{dec}.*.layer.1.EncDecAttention"
    unit = module.get_submodule(dec)[0].layer[1].EncDecAttention.key_value_proj_dim
    styles[cross] = {"style": "region", "inputs": ["key_value_states"]}
    styles.update({f"{cross}.{p}": {"style": "colwise_local", "unit": unit} for p in "qkv"})
    styles[f"{cross}.o"] = "rowwise"
    attrs[cross] = {"n_heads": "divide", "inner_dim": "divide"}
    return styles, attrs


class HFSeq2SeqPlan:
    """Builds a Plan for a Hugging Face encoder-decoder of BART's or T5's layout (plan="auto")."""

    name = "hf_seq2seq"

    def matches(self, module: nn.Module) -> bool:
        return getattr(getattr(module, "config", None), "is_encoder_decoder", False) is True and \
            hasattr(module, "get_output_embeddings") and _layout(module) is not None

    def build(self, module: nn.Module) -> Plan:
        enc, dec, kind = _layout(module)
        styles, attrs = (_bart if kind == "bart" else _t5)(enc, dec, module)
        head = module.get_output_embeddings()
        paths = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
        vocab = module.config.vocab_size
        for name, m in module.named_modules():  # token embeddings: the vocabulary's rows (not positions)
            if isinstance(m, nn.Embedding) and m.weight.shape[0] == vocab and "position" not in name:
                styles[name] = "vocab"
        if head is not None:
            styles[paths[id(head)]] = "lm_head"
        return Plan(name=f"hf_seq2seq_{kind}", styles=styles, attrs=attrs, blocks=(enc, dec))


PLANS = [HFSeq2SeqPlan()]
