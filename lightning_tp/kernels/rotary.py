"""Rotary position embedding, "both halves" style (GPT-NeoX / Llama ``rotate_half``), on (B, T, H, D)
or, with ``layout="bhtd"``, (B, H, T, D) inputs. See docs/design/kernels.md."""

from __future__ import annotations

import torch

from ._utils import block_size, tl, triton, use_triton


@triton.jit
def _rope_kernel(X, Y, Cos, Sin, T, H, HALF, cs_bstride, BACKWARD: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)  # = b * T + t
    b, t = tok // T, tok % T
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < HALF
    mask = (h < H) & dmask
    cs = b * cs_bstride + t * 2 * HALF + d
    c1 = tl.load(Cos + cs, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + cs + HALF, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + cs, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + cs + HALF, mask=dmask, other=0.0).to(tl.float32)
    base = tok * H * 2 * HALF + h * 2 * HALF + d
    x1 = tl.load(X + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + base + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + base, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + base + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    B, T, H, D = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _rope_kernel[(B * T,)](x, y, cos, sin, T, H, D // 2, 0 if cos.shape[0] == 1 else T * D, BACKWARD=backward,
                               BLOCK_H=block_size(H), BLOCK_D=block_size(D // 2))
    return y


class RotaryFunction(torch.autograd.Function):
    """Rotary on a (B, T, H, D) tensor; cos/sin already (1 or B, T, D) and contiguous."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, backward=True), None, None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "bthd") -> torch.Tensor:
    """Rotate ``x`` of shape (B, T, H, D) (``layout="bthd"``) or (B, H, T, D) (``"bhtd"``)."""
    if layout not in ("bthd", "bhtd"):
        raise ValueError(f"layout must be 'bthd' or 'bhtd', got {layout!r}")
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"expected a 4-D tensor with an even head dim, got {tuple(x.shape)}")
    xt = x.transpose(1, 2) if layout == "bhtd" else x  # -> (B, T, H, D)
    B, T, H, D = xt.shape
    cs = cos.reshape(-1, T, D) if cos.dim() != 3 else cos
    sn = sin.reshape(-1, T, D) if sin.dim() != 3 else sin
    if cs.shape[0] not in (1, B) or cs.shape != sn.shape or cs.shape[1:] != (T, D):
        raise ValueError(f"cos/sin must be (T, D), (1, T, D) or (B, T, D) with T={T}, D={D}; got "
                         f"{tuple(cos.shape)} / {tuple(sin.shape)}")
    if use_triton("rotary", xt, cs, sn):
        y = RotaryFunction.apply(xt, cs.contiguous(), sn.contiguous())
    else:
        c, s = cs[:, :, None, :].float(), sn[:, :, None, :].float()  # broadcast over heads
        xf = xt.float()
        y = (xf * c + _rotate_half(xf) * s).to(x.dtype)
    return y.transpose(1, 2) if layout == "bhtd" else y


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         layout: str = "bhtd") -> tuple[torch.Tensor, torch.Tensor]:
    """HF-compatible helper: rotate both ``q`` and ``k`` (default layout (B, H, T, D), like HF)."""
    return apply_rotary(q, cos, sin, layout), apply_rotary(k, cos, sin, layout)
