"""The fused norms under autocast give what the eager modules they replace give: the dtype the device's
autocast policy puts the op in (CUDA runs layer_norm in fp32), and the same numbers. On CPU the test also
puts the norms in an fp32 policy, as CUDA's, through an AutocastCPU kernel of its own."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_tp.kernels import FusedLayerNorm, FusedRMSNorm, _utils

AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


@contextlib.contextmanager
def fp32_policy(op: str):
    """``aten::<op>`` under CPU autocast casts its floating inputs to fp32, as CUDA autocast does."""
    lib = torch.library.Library("aten", "IMPL")

    def in_fp32(*args, **kwargs):
        cast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST_CPU):
            return getattr(torch.ops.aten, op)(*cast, **kwargs)

    lib.impl(op, in_fp32, "AutocastCPU")
    _utils._AUTOCAST_DTYPES.clear()  # what an eager op gives is probed once per policy: a new one here
    try:
        yield
    finally:
        lib._destroy()
        _utils._AUTOCAST_DTYPES.clear()


def _pair(kind):
    torch.manual_seed(0)
    eager = nn.LayerNorm(32) if kind == "layer_norm" else nn.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        eager.weight.uniform_(0.5, 1.5)
        if kind == "layer_norm":
            eager.bias.uniform_(-0.5, 0.5)
    fused = FusedLayerNorm.from_module(eager) if kind == "layer_norm" else FusedRMSNorm.from_module(eager)
    return eager, fused


@pytest.mark.parametrize("policy", ["cpu", "fp32 as cuda"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_fused_norms_under_bf16_autocast_match_eager(kind, policy):
    eager, fused = _pair(kind)
    x = (torch.randn(4, 8, 32) * 3 + 1).bfloat16()  # a bf16 activation, as a linear gives under autocast
    with fp32_policy(kind) if policy != "cpu" else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = eager(x), fused(x)
    assert got.dtype == want.dtype, (kind, policy, got.dtype, want.dtype)
    tol = 1e-5 if want.dtype == torch.float32 else 2 ** -7  # fp32 differences, or one bf16 rounding
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=0)
