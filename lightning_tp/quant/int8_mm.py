"""int8 x int8 -> int32 GEMM for the converted layers: ``torch._int_mm`` on CPU, Triton on CUDA.
See docs/design/quant.md."""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels._utils import HAS_TRITON, INTERPRET, tl, triton


@triton.jit
def _int8_mm_kernel(A, W, C, S, B, M, N, K, stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
                    DEQUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    # int64 offsets: row * stride overflows int32 once M * K (or M * N) reaches 2**31
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(A + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0)
        w = tl.load(W + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0)
        acc += tl.dot(a, w, out_dtype=tl.int32)
    c_ptrs = C + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if DEQUANT:
        s = tl.load(S + rn, mask=rn < N, other=0.0)
        out = acc.to(tl.float32) * s[None, :]
        if HAS_BIAS:
            out = out + tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptrs, out.to(C.dtype.element_ty), mask=c_mask)
    else:
        tl.store(c_ptrs, acc, mask=c_mask)


def _blocks(device: torch.device, M: int, N: int) -> tuple:
    """BLOCK_M, BLOCK_N, BLOCK_K, warps, stages; K-block >= 32 for int8 tensor cores."""
    if device.type != "cuda" or INTERPRET:
        return 32, 32, 32, 4, 1  # interpreter: fewer, cheaper programs
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if triton.cdiv(M, 128) * triton.cdiv(N, 128) >= sms:  # big enough to fill the GPU with 128x128 tiles
        return 128, 128, 64, 8, 3
    return 64, 64, 64, 4, 3  # small M (decode, tests): more programs


def triton_int8_mm(a: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None, out_dtype=torch.float32) -> torch.Tensor:
    """(M, K) int8 @ (N, K) int8 ^T. ``scale`` given: returns ``acc * scale + bias`` in ``out_dtype``
    (fused epilogue); otherwise the int32 accumulator."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed")
    M, K = a.shape
    N = w.shape[0]
    dequant = scale is not None
    c = torch.empty((M, N), dtype=out_dtype if dequant else torch.int32, device=a.device)
    if M == 0 or N == 0:
        return c
    bm, bn, bk, warps, stages = _blocks(a.device, M, N)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    s = scale.float().contiguous() if dequant else c
    b = bias.contiguous() if bias is not None else c
    _int8_mm_kernel[grid](a, w, c, s, b, M, N, K, a.stride(0), a.stride(1), w.stride(0), w.stride(1),
                          c.stride(0), c.stride(1), DEQUANT=dequant, HAS_BIAS=bias is not None,
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return c


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def padded_int_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm`` under its strictest constraints: M > 16 and K, N multiples of 8 (zero pad)."""
    M, K = a.shape
    N = w.shape[0]
    Mp, Kp, Np = max(17, _round_up(M, 8)), _round_up(K, 8), _round_up(N, 8)
    ap = a.new_zeros((Mp, Kp))
    ap[:M, :K] = a
    wp = w.new_zeros((Np, Kp))
    wp[:N, :K] = w
    return torch._int_mm(ap, wp.t())[:M, :N]


def int8_matmul(a: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """int32 ``a @ w.T`` for int8 a (M, K), w (N, K). backend: auto | int_mm | padded | triton."""
    if a.dtype != torch.int8 or w.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 operands, got {a.dtype} and {w.dtype}")
    if backend == "auto":
        backend = "triton" if a.is_cuda and HAS_TRITON else "int_mm"
    if backend == "triton":
        return triton_int8_mm(a, w)
    if backend == "padded":
        return padded_int_mm(a, w)
    if backend != "int_mm":
        raise ValueError(f"unknown int8 matmul backend {backend!r}; choose auto, int_mm, padded or triton")
    try:
        return torch._int_mm(a, w.t())
    except RuntimeError:  # shape constraints of this build: pad and slice
        return padded_int_mm(a, w)


def int8_linear(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype=torch.float32, backend: str = "auto") -> torch.Tensor:
    """``int8_matmul(a, w) * scale + bias`` (scale per output column, float32), in ``out_dtype``."""
    if backend == "auto":
        backend = "triton" if a.is_cuda and HAS_TRITON else "int_mm"
    if backend == "triton":
        return triton_int8_mm(a, w, scale, bias, out_dtype)
    y = int8_matmul(a, w, backend).float() * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
