"""Forward+backward time and peak memory of the fused kernels vs eager PyTorch and torch.compile.

Shapes are those of a 7B-class model step: 8 x 2048 tokens, hidden 4096, 32 heads of 128, MLP
16384, vocab 32k and 128k, bf16. Printed as ratios (baseline / fused: > 1 means the fused kernel
is faster or uses less memory). Needs a CUDA GPU; without one it says so and exits 0.

    python bench/fused_kernels.py [--only layer_norm,cross_entropy] [--no-compile]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F


def _cases(dev, dt):
    from lightning_tp import kernels as K

    T, Hd, nh, hd, ff = 8 * 2048, 4096, 32, 128, 16384

    def p(*s, dtype=dt):
        return torch.randn(*s, device=dev, dtype=dtype).requires_grad_()

    def rms_eager(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def rope_eager(q, cos, sin):
        q1, q2 = q.chunk(2, -1)
        return q * cos[:, None] + torch.cat((-q2, q1), -1) * sin[:, None]

    pos = torch.arange(2048, device=dev)[None].float()
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, device=dev).float() / hd)
    emb = torch.cat([pos[..., None] * inv] * 2, -1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    cases = [
        ("layer_norm", f"({T}, {Hd})", lambda: (p(T, Hd), p(Hd), p(Hd)),
         lambda x, w, b: F.layer_norm(x, (Hd,), w, b), lambda x, w, b: K.layer_norm(x, w, b)),
        ("rms_norm", f"({T}, {Hd})", lambda: (p(T, Hd), p(Hd)), rms_eager, lambda x, w: K.rms_norm(x, w, 1e-6)),
        ("bias_gelu", f"({T}, {ff})", lambda: (p(T, ff), p(ff)),
         lambda x, b: F.gelu(x + b, approximate="tanh"), lambda x, b: K.bias_gelu(x, b, "tanh")),
        ("rotary", "(8, 32, 2048, 128)", lambda: (p(8, nh, 2048, hd),), lambda q: rope_eager(q, cos, sin),
         lambda q: K.apply_rotary(q, cos[0], sin[0], "bhtd")),
    ]
    for V in (32000, 128256):
        tgt = torch.randint(0, V, (T,), device=dev)
        cases.append((f"cross_entropy V={V // 1000}k", f"({T}, {V})", lambda V=V: (p(T, V),),
                      lambda x, t=tgt: F.cross_entropy(x.float(), t), lambda x, t=tgt: K.fused_cross_entropy(x, t)))
    return cases


def _measure(fn, make):
    """(ms per fwd+bwd, peak extra bytes) for ``fn`` on fresh inputs from ``make``."""
    from triton.testing import do_bench

    inputs = make()
    out = fn(*inputs)
    grad = torch.randn_like(out) if out.dim() else None
    out.backward(grad)  # warm-up / compile

    def step():
        fn(*inputs).backward(grad)

    for t in inputs:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = do_bench(step, grad_to_none=list(inputs))
    inputs = out = grad = None  # free them before empty_cache (step() holds the cells)
    torch.cuda.empty_cache()
    return ms, peak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated op names (prefix match)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/fused_kernels.py needs a CUDA GPU (none found); nothing to measure.")
        return 0
    dev, dt = torch.device("cuda"), torch.bfloat16
    only = [o for o in args.only.split(",") if o]
    print(f"{torch.cuda.get_device_name()}  bf16  ratios = baseline / fused (>1: fused better)")
    print(f"{'op':26s} {'shape':28s} {'fused ms':>9s} {'t eager':>8s} {'t compile':>9s} {'mem eager':>9s} "
          f"{'mem compile':>11s}")
    for name, shape, make, eager, fused in _cases(dev, dt):
        if only and not any(name.startswith(o) for o in only):
            continue
        try:
            t_f, m_f = _measure(fused, make)
            t_e, m_e = _measure(eager, make)
            if args.no_compile:
                t_c = m_c = float("nan")
            else:
                try:
                    t_c, m_c = _measure(torch.compile(eager, dynamic=False), make)
                except Exception as e:  # a compile failure should not hide the other numbers
                    print(f"  torch.compile failed for {name}: {type(e).__name__}: {e}", file=sys.stderr)
                    t_c = m_c = float("nan")
        except torch.cuda.OutOfMemoryError:
            print(f"{name:26s} {shape:28s} out of memory")
            torch.cuda.empty_cache()
            continue
        m_f = max(m_f, 1)
        print(f"{name:26s} {shape:28s} {t_f:9.3f} {t_e / t_f:8.2f} {t_c / t_f:9.2f} {m_e / m_f:9.2f} {m_c / m_f:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
