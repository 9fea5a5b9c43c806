"""Plans for torch's own Transformer modules (and so Lightning's demo Transformer)."""

from .base import Plan

_LAYER = {
    "self_attn": "mha",
    "linear1": "colwise",
    "linear2": "rowwise",
    "norm1": "sp_norm",
    "norm2": "sp_norm",
}

TRANSFORMER_ENCODER = Plan(
    name="torch_transformer_encoder",
    targets=("TransformerEncoder",),
    styles={f"layers.*.{k}": v for k, v in _LAYER.items()},  # the final norm runs after sp_end: replicated
    sp_start="layers.*",
    sp_end="layers.*",
    blocks="layers",
)

TRANSFORMER_ENCODER_LAYER = Plan(
    name="torch_transformer_encoder_layer",
    targets=("TransformerEncoderLayer",),
    styles=dict(_LAYER),
    sp_start="",
    sp_end="",
)

# nn.Transformer (encoder-decoder; so also Lightning's demo Transformer). The decoder's cross-attention
# enters the TP region for its memory input on its own. Under pp its two lists form one chain of stages.
# Under SP each stack's sequence is split where its layers begin and gathered where the stack ends
# (after its final norm): the encoder's output reaches the cross-attention whole (by copy), the
# decoder's the user's head (outside the plan) whole.
TRANSFORMER = Plan(
    name="torch_transformer",
    targets=("Transformer",),
    requires=("encoder.layers", "decoder.layers"),
    styles={f"encoder.layers.*.{k}": v for k, v in _LAYER.items()}
    | {f"decoder.layers.*.{k}": v for k, v in _LAYER.items()}
    | {"decoder.layers.*.norm3": "sp_norm", "encoder.norm": "sp_norm", "decoder.norm": "sp_norm",
       "decoder.layers.*.multihead_attn": {"style": "mha", "whole_inputs": True}},
    sp_start=("encoder.layers.*", "decoder.layers.*"),
    sp_end=("encoder", "decoder"),
    blocks=("encoder.layers", "decoder.layers"),
)

MULTIHEAD_ATTENTION = Plan(name="torch_multihead_attention", targets=("MultiheadAttention",), styles={"": "mha"})

PLANS = [TRANSFORMER, TRANSFORMER_ENCODER, TRANSFORMER_ENCODER_LAYER, MULTIHEAD_ATTENTION]
