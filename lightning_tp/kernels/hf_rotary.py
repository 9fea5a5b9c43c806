"""``kernels=["rotary"]``: a Hugging Face family's ``apply_rotary_pos_emb`` (a function of its modeling module,
as Liger-Kernel patches it) runs the fused rotary kernel, where a check on random tensors shows the family's
math is the "both halves" rotation this kernel does. See docs/design/kernels.md."""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from .rotary import apply_rotary_pos_emb as fused_rotary

_MARK = "_lightning_tp_fused"


def _standard_call(signature, q, k, cos, sin, args, kwargs) -> bool:
    """A call the fused kernel computes exactly: (B, H, T, D) q/k and (B or 1, T, D) cos/sin of q's dtype
    (no gradient to them), no ``position_ids``, ``unsqueeze_dim`` 1, whichever way they are passed."""
    try:
        bound = signature.bind(q, k, cos, sin, *args, **kwargs).arguments
    except TypeError:
        return False
    extra = {name: value for name, value in bound.items() if name not in list(signature.parameters)[:4]}
    unsqueeze = extra.pop("unsqueeze_dim", 1)
    if extra.pop("position_ids", None) is not None or extra or type(unsqueeze) is not int or unsqueeze != 1:
        return False
    return (q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3 and cos.shape == sin.shape
            and cos.shape[-1] == q.shape[-1] == k.shape[-1] and cos.shape[-2] == q.shape[-2] == k.shape[-2]
            and cos.shape[0] in (1, q.shape[0]) and q.dtype == k.dtype == cos.dtype == sin.dtype
            and not (cos.requires_grad or sin.requires_grad))


def _fused_twin(original):
    signature = inspect.signature(original)

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _standard_call(signature, q, k, cos, sin, args, kwargs):
            return fused_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    setattr(apply_rotary_pos_emb, _MARK, original)
    return apply_rotary_pos_emb


def _same_math(original) -> bool:
    """The family's function and the fused one agree on random q, k, cos and sin (not a rotation's own)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(2))
    cos, sin = (torch.randn(1, 5, 8, generator=g) for _ in range(2))
    try:
        want = original(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - another signature: left alone
        return False
    got = fused_rotary(q, k, cos, sin)
    return all(torch.allclose(a, b, atol=1e-5) for a, b in zip(want, got))


def patch_hf_rotary(model: nn.Module) -> list:
    """Patch the modeling modules of ``model``'s classes; returns the names of those patched (now or before)."""
    patched = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if not name.startswith("transformers.") or not callable(fn):
            continue
        if not hasattr(fn, _MARK):
            if not _same_math(fn):
                continue
            module.apply_rotary_pos_emb = _fused_twin(fn)
        patched.append(name)
    return patched
