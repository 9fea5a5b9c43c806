"""Shared plumbing for the fused kernels: Triton availability, path choice, warnings, block sizes.

See docs/design/kernels.md."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator, Optional

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - platforms without a Triton wheel
    HAS_TRITON = False

    class _Stub:
        """Lets the kernel modules define (never run) their ``@triton.jit`` functions."""

        constexpr = object

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, int(n) - 1).bit_length()

    triton = tl = _Stub()  # type: ignore[assignment]

#: Read once; see docs/design/kernels.md for why not at call time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Set by :func:`torch_path` (tests, debugging) to force the reference implementation.
_FORCE_TORCH = False
#: Ops that already warned about falling back; one warning per op per process.
_WARNED: set[str] = set()


#: (op, device type, input dtype, autocast dtype) -> the dtype autocast runs the eager op in.
_AUTOCAST_DTYPES: dict = {}


def autocast_input(op: str, eager, x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype the device's autocast runs the eager op in (CUDA: fp32 for layer_norm), so a
    fused twin gives eager's dtype and numbers; ``x`` itself outside autocast. ``eager`` maps a (1, 1) tensor."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x
    key = (op, device, x.dtype, torch.get_autocast_dtype(device))
    if key not in _AUTOCAST_DTYPES:  # probed once: a one-element eager op under the active autocast
        _AUTOCAST_DTYPES[key] = eager(torch.ones((1, 1), device=x.device, dtype=x.dtype)).dtype
    return x.to(_AUTOCAST_DTYPES[key])


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Run every op on its pure-torch path inside the block (no warning: it was asked for)."""
    global _FORCE_TORCH
    old, _FORCE_TORCH = _FORCE_TORCH, True
    try:
        yield
    finally:
        _FORCE_TORCH = old


def fallback(op: str, reason: str) -> bool:
    """Warn once per ``op`` that the torch path is used instead of Triton; always returns False."""
    if op not in _WARNED:
        _WARNED.add(op)
        warnings.warn(f"lightning_tp.kernels.{op}: {reason}; using the PyTorch path", stacklevel=3)
    return False


def supported_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """fp32/fp16 everywhere; bf16 only compiled on a GPU (the interpreter's bf16 math is wrong)."""
    if device.type == "cuda" and not INTERPRET:
        return (torch.float32, torch.float16, torch.bfloat16)
    return (torch.float32, torch.float16)


def use_triton(op: str, *tensors: Optional[torch.Tensor], max_cols: Optional[int] = None, cols: int = 0) -> bool:
    """Decide the path for one call. Silent torch path for plain CPU tensors; warn-once otherwise.
    ``tensors``: the floating inputs whose dtype the kernel must support (``None`` skipped); ``max_cols``
    bounds a single-block row length ``cols``. See docs/design/kernels.md."""
    if _FORCE_TORCH:
        return False
    present = [t for t in tensors if t is not None]
    first = present[0]
    if not (first.is_cuda or INTERPRET):
        return False  # the ordinary CPU path; not a fallback, so no warning
    if not HAS_TRITON:
        return fallback(op, "Triton is not installed")
    ok = supported_dtypes(first.device)
    for t in present:
        if t.dtype not in ok:
            return fallback(op, f"dtype {t.dtype} is not supported by the Triton kernel")
    if max_cols is not None and cols > max_cols:
        return fallback(op, f"row length {cols} exceeds the single-block limit {max_cols}")
    return True


def block_size(n: int, cap: int = 65536) -> int:
    """Smallest power of two >= n, capped; Triton blocks must be powers of two."""
    return min(triton.next_power_of_2(max(int(n), 1)), cap)


def num_warps(block: int) -> int:
    """Warps per program for a row-wise kernel of width ``block`` (the common Triton heuristic)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def num_programs(rows: int, device: torch.device) -> int:
    """Programs for reductions over rows (norm backward): one per SM on a GPU, few in the interpreter."""
    if device.type == "cuda" and not INTERPRET:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, sms))
    return max(1, min(rows, 4))
