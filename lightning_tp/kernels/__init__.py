"""Triton fused kernels (with pure-torch twins) for the hot elementwise/row-wise ops of a transformer.

Path choice and fallbacks: ``_utils.use_triton``; see docs/design/kernels.md."""

from ._utils import HAS_TRITON, INTERPRET, torch_path
from .cross_entropy import FusedCrossEntropyLoss, fused_cross_entropy
from .gelu import FusedBiasGeLU, bias_gelu
from .layernorm import FusedLayerNorm, layer_norm
from .rmsnorm import FusedRMSNorm, rms_norm
from .rotary import apply_rotary, apply_rotary_pos_emb

__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "torch_path",
    "layer_norm",
    "FusedLayerNorm",
    "rms_norm",
    "FusedRMSNorm",
    "bias_gelu",
    "FusedBiasGeLU",
    "apply_rotary",
    "apply_rotary_pos_emb",
    "fused_cross_entropy",
    "FusedCrossEntropyLoss",
]
