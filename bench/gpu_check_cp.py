"""gpu_check's context-parallel rows on one device: the ring's own autograd Function, its cp ranks run as
threads that pass K/V and dK/dV through queues instead of NCCL, against SDPA on the whole sequence; and each
block kernel (flash, memory-efficient) against the fp32 math blocks. Run by bench/gpu_check.py."""

from __future__ import annotations

import queue
import threading

import torch
import torch.nn.functional as F

from lightning_tp.context import blocks, ring
from lightning_tp.context.chunks import global_positions

NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class _Ctx:
    """Stands in for autograd's ctx when the ring's forward and backward are called directly."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class _Received:
    def __init__(self, box: queue.Queue, into: torch.Tensor):
        self.box, self.into = box, into

    def wait(self):
        self.into.copy_(self.box.get(timeout=120))


class ThreadRing:
    """The ring's transport for cp ranks that are threads of one process (one queue per link and tag)."""

    def __init__(self, cp: int):
        self.cp = cp
        self.boxes = {(a, tag): queue.Queue() for a in range(cp) for tag in (ring.KV_TAG, ring.GRAD_TAG)}

    def exchange(self, send, recv, links, tag):
        _, nxt, prev = links
        self.boxes[(nxt, tag)].put(send.clone())  # the box of the rank it goes to
        return [_Received(self.boxes[((prev + 1) % self.cp, tag)], recv)]


def ring_in_threads(q, k, v, grad, cp: int, scale: float):
    """(out, dq, dk, dv) on the whole sequence, from cp threads each running the ring on its chunks."""
    t = q.shape[2]
    parts = [global_positions(t, cp, r, q.device) for r in range(cp)]
    transport, results, errors = ThreadRing(cp), {}, []
    own = ring._exchange
    ring._exchange = transport.exchange

    def rank(r):
        try:
            ctx, links = _Ctx(), (None, (r + 1) % cp, (r - 1) % cp)
            out = ring._RingAttention.forward(ctx, *(x[:, :, parts[r]].contiguous() for x in (q, k, v)), scale, True,
                                              links, cp, r)
            results[r] = (out, *ring._RingAttention.backward(ctx, grad[:, :, parts[r]].contiguous())[:3])
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        ring._exchange = own
    if errors:
        raise errors[0]
    whole = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, q, k, v)]
    for r in range(cp):
        for w, got in zip(whole, results[r]):
            w[:, :, parts[r]] = got
    return whole


class _Loopback:
    """A transport whose 'received' block is the one sent: one rank's work and launches, for its time alone."""

    def exchange(self, send, recv, links, tag):
        recv.copy_(send)
        return []


def one_rank(q, k, v, grad, cp: int, scale: float):
    """Forward and backward of cp rank 0's ring on its chunks, every K/V block its own (numbers not judged)."""
    parts = global_positions(q.shape[2], cp, 0, q.device)
    own, ring._exchange = ring._exchange, _Loopback().exchange
    try:
        ctx = _Ctx()
        ring._RingAttention.forward(ctx, *(x[:, :, parts] for x in (q, k, v)), scale, True, (None, 1 % cp, -1 % cp),
                                    cp, 0)
        ring._RingAttention.backward(ctx, grad[:, :, parts])
    finally:
        ring._exchange = own


def _reference(q, k, v, grad, scale, dtype=None):
    """SDPA on the whole sequence (K/V heads repeated), forward and backward: (out, dq, dk, dv)."""
    groups = q.shape[1] // k.shape[1]
    xs = [x.detach().to(dtype or x.dtype).requires_grad_() for x in (q, k, v)]
    kk, vv = (x.repeat_interleave(groups, dim=1) for x in xs[1:])
    out = F.scaled_dot_product_attention(xs[0], kk, vv, is_causal=True, scale=scale)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [x.grad for x in xs]


def check_ring(dev, dry: bool, rel_err, fmt_e, median_ms):
    """One row per dtype: the threaded ring against SDPA on the whole sequence, both against float64; the
    ring passes at twice the one-device SDPA's own error (or 1e-4). Timing: one rank's ring without transfers
    against a cp-th of SDPA on the whole sequence (1.0: no overhead beyond the split)."""
    cases = [(torch.float32, (1, 4, 2, 64, 8))] if dry else [
        (torch.float32, (2, 8, 2, 4000, 64)),  # memory-efficient blocks, 500-token chunks (lse padding)
        (torch.float16, (2, 8, 2, 4096, 64)),  # flash blocks
        (torch.bfloat16, (2, 16, 4, 8192, 128)),  # flash blocks, GQA 4:1, head dim 128
    ]
    rows = []
    for dt, (b, h, hkv, t, d) in cases:
        cp, scale = 4, d ** -0.5
        torch.manual_seed(0)
        q = torch.randn(b, h, t, d, device=dev).to(dt)
        k, v = (torch.randn(b, hkv, t, d, device=dev).to(dt) for _ in range(2))
        grad = torch.randn(b, h, t, d, device=dev).to(dt)
        ref = _reference(q, k, v, grad, scale, torch.float64)
        one = _reference(q, k, v, grad, scale)
        got = ring_in_threads(q, k, v, grad, cp, scale)
        err = max(rel_err(g, r) for g, r in zip(got, ref))
        base = max(rel_err(g, r) for g, r in zip(one, ref))
        tol = max(2 * base, 1e-4)
        kind = blocks.kernel(q)
        fig = (f"cp={cp} threads, {b}x{h} heads ({hkv} K/V) x {t} tokens x {d}, {kind} blocks: err {fmt_e(err)} "
               f"(one-device SDPA {fmt_e(base)}, tol {fmt_e(tol)}) vs float64, output and dq, dk, dv")
        if not dry:
            t_rank = median_ms(lambda: one_rank(q, k, v, grad, cp, scale), reps=5, warmup=2)
            t_sdpa = median_ms(lambda: _reference(q, k, v, grad, scale), reps=5, warmup=2)
            blocks.FORCE = "math"
            try:
                t_math = median_ms(lambda: one_rank(q, k, v, grad, cp, scale), reps=5, warmup=2)
            finally:
                blocks.FORCE = None
            fig += (f"; t one rank/(SDPA/cp) {t_rank * cp / t_sdpa:.2f} ({t_rank:.2f}/{t_sdpa / cp:.2f} ms, no "
                    f"transfer), t {kind}/math blocks {t_rank / t_math:.2f}")
        rows.append((f"cp ring {NAME[dt]} (cp={cp} threads)", "PASS" if err <= tol else "FAIL", fig))
    return rows


def _kernels(dt, dry: bool) -> list:
    if dry:
        return ["flash_cpu"]
    return ["efficient"] if dt is torch.float32 else ["flash"]


def check_blocks(dev, dry: bool, rel_err, fmt_e):
    """Each block kernel against the fp32 math block on the same (rounded) inputs, causal and not, forward (out,
    lse) and backward from a merged (out, lse) of two blocks, as the ring calls them: a row per dtype and kernel."""
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}
    shapes = [(16, 8)] if dry else [(500, 64), (512, 128), (96, 64)]
    rows = []
    for dt in [torch.float32] if dry else [torch.float32, torch.float16, torch.bfloat16]:
        for name in _kernels(dt, dry):
            try:
                worst = _block_error(dt, name, shapes, dev, rel_err)
            except Exception as e:  # noqa: BLE001 - one kernel's failure is its row's
                rows.append((f"cp blocks {NAME[dt]} {name}", "FAIL", " ".join(f"{type(e).__name__}: {e}".split())[:200]))
                continue
            rows.append((f"cp blocks {NAME[dt]} {name}", "PASS" if worst <= tol[dt] else "FAIL",
                         f"{name} vs fp32 math blocks: err {fmt_e(worst)} (tol {tol[dt]:.0e}) over out, lse, dq, dk, "
                         f"dv; chunks of {', '.join(str(c) for c, _ in shapes)} tokens, causal and not"))
    return rows


def _block_error(dt, name, shapes, dev, rel_err) -> float:
    worst = 0.0
    for c, d in shapes:
        torch.manual_seed(1)
        q, k1, v1, k2, v2, dout = (torch.randn(2, 4, c, d, device=dev).to(dt) for _ in range(6))
        scale = d ** -0.5
        for causal in (False, True):
            got, want = {}, {}
            for how, into in ((name, got), ("math", want)):
                blocks.FORCE = how
                try:
                    into["f"] = blocks.forward(q, k1, v1, False, scale), blocks.forward(q, k2, v2, causal, scale)
                    if how == "math":
                        (m1, n1), (m2, n2) = into["f"]
                        out, lse = torch.zeros_like(m1), torch.full_like(n1, float("-inf"))
                        blocks.merge(out, lse, m1, n1)
                        blocks.merge(out, lse, m2, n2)
                finally:
                    blocks.FORCE = None
            for how, into in ((name, got), ("math", want)):
                blocks.FORCE = how
                try:
                    into["b"] = blocks.backward(dout, q, k2, v2, out, lse, causal, scale)
                finally:
                    blocks.FORCE = None
            pairs = [*zip(got["f"][0], want["f"][0]), *zip(got["f"][1], want["f"][1]), *zip(got["b"], want["b"])]
            worst = max(worst, *(rel_err(g, w) for g, w in pairs))
    return worst


def check_speed(dev, dry: bool, median_ms):
    """One rank's ring (no transfers) per block kernel against a cp-th of SDPA on the whole sequence, bf16."""
    if dry:
        return "SKIP", "skipped: no GPU"
    b, h, hkv, t, d = 1, 32, 8, 32768, 128
    torch.manual_seed(0)
    q = torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, t, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    grad, scale = torch.randn_like(q), d ** -0.5
    t_sdpa = median_ms(lambda: _reference(q, k, v, grad, scale), reps=5, warmup=2)
    figs = []
    for cp in (2, 4, 8):
        parts = []
        for name in ("flash", "math"):
            blocks.FORCE = name
            try:
                ms = median_ms(lambda: one_rank(q, k, v, grad, cp, scale), reps=5, warmup=2)
                parts.append(f"{name} {ms * cp / t_sdpa:.2f}")
            except Exception as e:  # noqa: BLE001 - a kernel this torch lacks is reported, not fatal
                parts.append(f"{name} {type(e).__name__}")
            finally:
                blocks.FORCE = None
        figs.append(f"cp={cp}: " + ", ".join(parts))
    return "INFO", (f"{b}x{h} heads ({hkv} K/V) x {t} tokens x {d} bf16, one rank's ring fwd+bwd (no transfer) / "
                    f"(SDPA fwd+bwd on the whole sequence {t_sdpa:.1f} ms / cp): " + "; ".join(figs))
