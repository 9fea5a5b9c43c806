"""Triton fused kernels (with pure-torch twins) for the hot elementwise/row-wise ops of a transformer.

Each op is an autograd Function with a Triton forward and backward, a functional entry point that
picks the Triton or torch path (see ``_utils``), and, where a module is replaced, an ``nn.Module``
with a ``from_module`` classmethod that takes over the original's parameters.

Path choice (``_utils.use_triton``): Triton for CUDA tensors, or for CPU tensors when the process
was started with ``TRITON_INTERPRET=1`` (read at import, as Triton does); the torch twin otherwise.
Falls back to torch with one warning per op for: dtypes other than fp32/fp16 (bf16 is accepted
compiled on CUDA but refused in the interpreter, whose bf16 math is wrong), rows wider than a
single block for norms (65536) and softmax (32768), a missing Triton, and class weights or label
smoothing in ``FusedCrossEntropyLoss``.
"""

from ._utils import HAS_TRITON, INTERPRET, torch_path
from .cross_entropy import FusedCrossEntropyLoss, fused_cross_entropy
from .dropout_add import bias_dropout_add, dropout_keep_mask
from .gelu import FusedBiasGeLU, bias_gelu
from .layernorm import FusedLayerNorm, layer_norm
from .rmsnorm import FusedRMSNorm, rms_norm
from .rotary import apply_rotary, apply_rotary_pos_emb
from .softmax import fused_softmax

__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "torch_path",
    "layer_norm",
    "FusedLayerNorm",
    "rms_norm",
    "FusedRMSNorm",
    "fused_softmax",
    "bias_gelu",
    "FusedBiasGeLU",
    "bias_dropout_add",
    "dropout_keep_mask",
    "apply_rotary",
    "apply_rotary_pos_emb",
    "fused_cross_entropy",
    "FusedCrossEntropyLoss",
]
