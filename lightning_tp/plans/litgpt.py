"""Plan for litgpt's ``GPT`` (fused [q | k | v] with grouped queries). See docs/design/plans.md."""

from __future__ import annotations

from torch import nn

from .base import Plan


class LitGPTPlan:
    name = "litgpt_gpt"

    def matches(self, module: nn.Module) -> bool:
        return type(module).__name__ == "GPT" and type(module).__module__.startswith("litgpt")

    def build(self, module: nn.Module) -> Plan:
        c = module.config
        sections = [c.n_head * c.head_size, c.n_query_groups * c.head_size, c.n_query_groups * c.head_size]
        mlp = module.transformer.h[0].mlp
        styles = {
            "transformer.wte": "vocab",
            "transformer.h.*.attn": "region",
            "transformer.h.*.attn.qkv": {"style": "colwise_local", "sections": sections, "unit": c.head_size,
                                         "replicate_heads": [1, 2]},  # k, v: copied when tp > n_query_groups
            "transformer.h.*.attn.proj": "rowwise",
            "transformer.h.*.norm_1": "sp_norm",
            "transformer.h.*.norm_2": "sp_norm",
            "transformer.h.*.post_attention_norm": "sp_norm",
            "transformer.h.*.post_mlp_norm": "sp_norm",
            "transformer.ln_f": "sp_norm",
            "lm_head": "lm_head",
        }
        if hasattr(mlp, "fc_1"):  # LLaMAMLP: silu(fc_1(x)) * fc_2(x)
            styles.update({"transformer.h.*.mlp": "region", "transformer.h.*.mlp.fc_1": "colwise_local",
                           "transformer.h.*.mlp.fc_2": "colwise_local", "transformer.h.*.mlp.proj": "rowwise"})
        else:  # GptNeoxMLP
            styles.update({"transformer.h.*.mlp.fc": "colwise", "transformer.h.*.mlp.proj": "rowwise"})
        return Plan(name=self.name, styles=styles,
                    attrs={"transformer.h.*.attn": {"config.n_head": "divide", "config.n_query_groups": "kv_heads"}},
                    sp_start="transformer.h.*", blocks="transformer.h")


PLANS = [LitGPTPlan()]
