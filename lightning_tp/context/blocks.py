"""One block of attention (a query chunk against a key chunk) with its log-sum-exp, and its backward
given the merged output and log-sum-exp: torch's flash kernel on CPU, plain fp32 math elsewhere."""

from __future__ import annotations

import torch


def _flash_cpu(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def forward(q, k, v, causal: bool, scale: float):
    """(out in fp32, lse in fp32) of softmax(q kᵀ * scale) v, causal within the (square) block if asked."""
    if _flash_cpu(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse.float()
    with torch.autocast(q.device.type, enabled=False):  # the backward's products are fp32 too
        return _math_forward(q, k, v, causal, scale)


def _math_forward(q, k, v, causal: bool, scale: float):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_above_diagonal(s), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()), lse


def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) in fp32 of one block, given the whole row's output ``out`` and ``lse``."""
    if _flash_cpu(q):
        dt = q.dtype
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(dt), q, k, v, out.to(dt), lse.float(), 0.0, causal, scale=scale)
        return dq.float(), dk.float(), dv.float()
    with torch.autocast(q.device.type, enabled=False):
        return _math_backward(dout, q, k, v, out, lse, causal, scale)


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


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running ones, in place (lse starts at -inf, out at 0)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)
