"""Plan for the project's example GPT (examples/gpt/model.py): separate q/k/v, GELU MLP."""

from .base import Plan

EXAMPLE_GPT = Plan(
    name="example_gpt",
    targets=("GPT",),
    requires=("transformer.wte", "transformer.h.0.attn.q_proj"),
    styles={
        "transformer.wte": "vocab",
        "transformer.h.*.attn": "region",
        "transformer.h.*.attn.q_proj": "colwise_local",
        "transformer.h.*.attn.k_proj": "colwise_local",
        "transformer.h.*.attn.v_proj": "colwise_local",
        "transformer.h.*.attn.o_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "transformer.h.*.ln_1": "sp_norm",
        "transformer.h.*.ln_2": "sp_norm",
        "transformer.ln_f": "sp_norm",
        "lm_head": "lm_head",
        "loss_fn": "vocab_ce",
    },
    attrs={"transformer.h.*.attn": {"n_head": "divide"}},
    sp_start="transformer.drop",
    blocks="transformer.h",
)

PLANS = [EXAMPLE_GPT]
