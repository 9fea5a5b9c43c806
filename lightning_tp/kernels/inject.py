"""Swap the user's norm, activation and loss modules for the fused ones (``MegaStrategy(kernels=...)``),
keeping the original Parameter objects, and a Hugging Face family's rotary function. See docs/design/kernels.md."""

from __future__ import annotations

from torch import nn

KERNELS = ("layernorm", "rmsnorm", "gelu", "cross_entropy", "rotary")


def kernel_names(kernels) -> tuple:
    """``True`` -> all, ``False``/``None`` -> none, a list -> checked subset."""
    if kernels is True:
        return KERNELS
    if not kernels:
        return ()
    names = (kernels,) if isinstance(kernels, str) else tuple(kernels)
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"MegaStrategy(kernels=...): unknown kernel(s) {unknown}; choose from {list(KERNELS)} "
                         f"or pass True for all.")
    return names


def _is_rmsnorm(m: nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "weight")


def _fused(module: nn.Module, names: tuple):
    from . import FusedBiasGeLU, FusedCrossEntropyLoss, FusedLayerNorm, FusedRMSNorm

    if "layernorm" in names and type(module) is nn.LayerNorm and module.elementwise_affine:
        return FusedLayerNorm.from_module(module)
    if "rmsnorm" in names and _is_rmsnorm(module):
        return FusedRMSNorm.from_module(module)
    if "gelu" in names and type(module) is nn.GELU:
        return FusedBiasGeLU.from_module(module)
    if "cross_entropy" in names and type(module) is nn.CrossEntropyLoss:
        return FusedCrossEntropyLoss.from_module(module)
    if "cross_entropy" in names and hasattr(module, "fused"):  # VocabParallelCrossEntropy
        module.fused = True
    return None


def apply_kernels(model: nn.Module, kernels) -> list:
    """Replace modules in place; returns the replaced paths."""
    names, done = kernel_names(kernels), []
    if not names:
        return done
    if "rotary" in names:  # a function of the family's module, not a module of the model
        from .hf_rotary import patch_hf_rotary

        done += [f"{m}.apply_rotary_pos_emb" for m in patch_hf_rotary(model)]
    for path, module in list(model.named_modules()):
        new = _fused(module, names)
        if new is not None:
            model.set_submodule(path, new)
            done.append(path)
    return done
