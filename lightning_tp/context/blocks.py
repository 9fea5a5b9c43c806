"""One block of attention (a query chunk against a key chunk) with its log-sum-exp, and its backward
given the merged output and log-sum-exp: torch's fused kernels where they return the log-sum-exp
(flash on CPU; flash or memory-efficient on CUDA), plain fp32 math elsewhere."""

from __future__ import annotations

import torch

aten = torch.ops.aten
LSE_ALIGN = 32  # the memory-efficient kernel pads its log-sum-exp rows to a multiple of this
NO_RNG = torch.empty((), dtype=torch.int64)  # the CUDA backwards' random-number state: never read without dropout
FORCE = None  # a kernel's name forces it ("math": the GPU check's reference); None picks per input


def kernel(q: torch.Tensor) -> str:
    """Which implementation runs a block of ``q``: 'flash_cpu', 'flash', 'efficient' or 'math'."""
    if FORCE:
        return FORCE
    if q.device.type == "cpu":
        return "flash_cpu" if q.dtype in (torch.float32, torch.bfloat16) else "math"
    if q.device.type != "cuda":
        return "math"
    d = q.shape[-1]
    if q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256:
        return "flash"
    return "efficient" if q.dtype == torch.float32 and d % 8 == 0 else "math"  # efficient on fp16/bf16 crashed


def forward(q, k, v, causal: bool, scale: float):
    """(out, lse in fp32) of softmax(q kᵀ * scale) v, causal within the (square) block if asked; out in the
    kernel's dtype (q's, or fp32 for the math)."""
    how = kernel(q)
    if how == "flash_cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    elif how == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    elif how == "efficient":
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        lse = lse[..., :q.shape[-2]]
    else:
        with torch.autocast(q.device.type, enabled=False):  # the backward's products are fp32 too
            return _math_forward(q, k, v, causal, scale)
    return out, lse.float()


def _math_forward(q, k, v, causal: bool, scale: float):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_above_diagonal(s), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()), lse


def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one block, given the whole row's output ``out`` and ``lse`` (pass them in q's dtype and
    contiguous fp32 to spare a copy per block); in q's dtype, or fp32 for the math."""
    how = kernel(q)
    if how == "math":
        with torch.autocast(q.device.type, enabled=False):
            return _math_backward(dout, q, k, v, out, lse, causal, scale)
    dt, lse = q.dtype, lse.float().contiguous()
    dout, out = dout.to(dt), out.to(dt)
    if how == "flash_cpu":
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                          scale=scale)
    elif how == "flash":
        grads = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, NO_RNG, NO_RNG, scale=scale)
    else:
        pad = -q.shape[-2] % LSE_ALIGN
        lse = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        grads = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, NO_RNG, NO_RNG, 0.0, [True, True, True, False], causal, scale=scale)
    return grads[:3]


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    qf, kf, vf, do = q.float(), k.float(), v.float(), dout.float()
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_above_diagonal(s), float("-inf"))
    p = torch.exp(s - lse.float().unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    return torch.matmul(ds, kf) * scale, torch.matmul(ds.transpose(-1, -2), qf) * scale, dv


def _above_diagonal(s: torch.Tensor) -> torch.Tensor:
    n, m = s.shape[-2:]
    return torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
          first: bool = False) -> None:
    """Fold one block's (out, lse) into the running fp32 ones, in place; ``first``: they hold nothing yet."""
    if first:
        out.copy_(block_out)
        lse.copy_(block_lse)
        return
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)
