"""Plan for Hugging Face Falcon (``FalconForCausalLM``), whose config carries no tensor-parallel plan.
See docs/design/plans.md."""

from __future__ import annotations

from torch import nn

from .base import Plan
from .hf import norm_paths


class FalconPlan:
    name = "hf_falcon"

    def matches(self, module: nn.Module) -> bool:
        return "FalconForCausalLM" in {c.__name__ for c in type(module).__mro__} and \
            isinstance(getattr(getattr(module, "transformer", None), "h", None), nn.ModuleList)

    def blocks_of(self, module: nn.Module) -> str:
        return "transformer.h"

    def build(self, module: nn.Module) -> Plan:
        c = module.config
        if c.alibi:
            raise ValueError(f"{type(module).__name__} with alibi=True: its ALiBi biases are built for every head "
                             f"outside the attention, which under tp holds only its rank's heads; tp is not "
                             f"supported for it. Use pp and dp.")
        head_dim = c.hidden_size // c.num_attention_heads
        attn = "transformer.h.*.self_attention"
        if c.new_decoder_architecture:
            qkv = {"style": "colwise_local", "unit": (c.num_attention_heads // c.num_kv_heads + 2) * head_dim}
            attrs = {"num_heads": "divide", "num_kv_heads": "divide"}
        elif c.multi_query:
            qkv = {"style": "colwise_local", "sections": [c.hidden_size, head_dim, head_dim], "unit": head_dim,
                   "replicate_heads": [1, 2]}
            attrs = {"num_heads": "divide"}
            if hasattr(module.transformer.h[0].self_attention, "num_key_value_groups"):  # transformers 5: read by
                attrs["num_key_value_groups"] = "divide"  # repeat_kv, as many query heads per copied k/v head
        else:
            qkv = {"style": "colwise_local", "unit": 3 * head_dim}
            attrs = {"num_heads": "divide", "num_kv_heads": "divide"}
        styles = {
            "transformer.word_embeddings": "vocab",
            attn: "region",
            f"{attn}.query_key_value": qkv,
            f"{attn}.dense": "rowwise",
            "transformer.h.*.mlp.dense_h_to_4h": "colwise",
            "transformer.h.*.mlp.dense_4h_to_h": "rowwise",
            **norm_paths(module.transformer.h[0], "transformer.h.*"),
            "transformer.ln_f": "sp_norm",
            "lm_head": "lm_head",
        }
        return Plan(name=self.name, styles=styles, attrs={attn: attrs}, sp_start="transformer.h.*",
                    blocks="transformer.h", outputs="transformer")


PLANS = [FalconPlan()]
