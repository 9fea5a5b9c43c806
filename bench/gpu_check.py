"""Every check that needs a GPU, in one run of under five minutes on one GPU; prints ONE table.

    bench/gpu_check.sh                  # on a machine with a CUDA GPU (the wrapper picks the Python)
    bench/gpu_check.sh --cpu-dry-run    # the same plumbing on CPU: Triton interpreter, tiny sizes
    python bench/gpu_check.py --help

Rows (check | result | figure):
  * ``env``: torch / CUDA / GPU / Triton / NCCL versions.
  * ``kernel <op> <dtype>``: each fused Triton kernel of ``lightning_tp.kernels`` against its eager
    torch twin, forward + backward, in fp32, fp16 and bf16. Correctness is judged against a float64
    reference on the same (rounded) inputs: the max error over the output and every gradient,
    divided by that tensor's max magnitude, must be under the dtype's tolerance (fp32 1e-4,
    fp16 5e-3, bf16 4e-2) or at most twice the eager twin's own error. Speed: ``t k/e`` = kernel time
    / eager time of one forward+backward (median of N CUDA-event timings after warm-up; < 1 means the
    kernel is faster). Memory: ``mem k/e`` = peak extra memory (torch.cuda.max_memory_allocated
    above what was allocated before the step) of the kernel / eager. A row whose op fell back to its
    torch path (a "using the PyTorch path" warning) FAILs: it would not have tested the kernel.
  * ``int8 GEMM``: the Triton int8 x int8 -> int32 GEMM (and its fused dequant epilogue, and
    ``torch._int_mm``) against an exact reference; its speed against an fp16 matmul.
  * ``gpt step kernels=True`` / ``gpt step quant=int8``: one training step of the example GPT on the
    GPU against the same step on CPU (torch path): loss, every gradient, the loss after an SGD step.
    ``gpt int8 convert``: the converted (true int8 GEMM) model, GPU against CPU: each layer on the same
    codes (4 fp32 ulps), codes at most one step apart, logits on the same codes (docs/gpu.md).
  * ``nccl init``: a one-process NCCL group and an all_reduce (two processes need two GPUs).
  * ``trainer fit``: ``MegaStrategy(tp=1, kernels=True)`` + ``L.Trainer(accelerator="gpu",
    devices=1)`` fits a few steps: the CUDA/NCCL path of the strategy starts and trains.
  * ``trainer fit 16-mixed | bf16-mixed | microbatches=2 | checkpointing + dropout | quant=int8`` and
    ``checkpoint sync | async: resume + consolidate``: fits on the device against a reference fit there
    (Lightning's own strategy, or the same strategy without the feature); see bench/gpu_check_train.py.
  * ``expert layer``: the MoE layer on the device against CPU, and its time against the block's own loop;
  * ``compiled <op> bf16``: the kernel under ``torch.compile`` against the float64 reference, and
    its time against ``torch.compile`` of the eager twin. An error raised by dynamo/inductor reads
    UNSUPPORTED (not a failure); wrong numbers FAIL.
  * ``grouped expert GEMM``: ModuleList experts (the example GPT's) behind the dispatch as one grouped GEMM
    per projection against the same layer's loop over them.
  * ``hf 5.x experts (grouped_mm) dispatched``: a transformers 5 Mixtral block whose experts module (3-D
    weights, its own grouped_mm) runs behind the expert-parallel dispatch, against the block's own.
  * ``cp blocks <dtype>`` / ``cp ring <dtype>``: context parallelism's block kernels against its fp32 math
    blocks, and its ring (cp=4 ranks as threads) against SDPA on the whole sequence; bench/gpu_check_cp.py.

Each check is guarded: an exception gives a FAIL row with the error (traceback on stderr) and the
rest still run. Checks that would start after ``--budget`` seconds are skipped. Exit status 1 when
any row FAILs, 2 when no GPU was found and ``--cpu-dry-run`` was not given, else 0.

``--cpu-dry-run`` (or ``GPU_CHECK_CPU_DRY_RUN=1``) hides any GPU, sets ``TRITON_INTERPRET=1`` and
uses tiny sizes: the kernels run in the Triton interpreter on CPU tensors, the GPT steps compare
the interpreted kernels with the torch path, the trainer fits on CPU with gloo, and the CUDA-only
rows (bf16 kernels, NCCL, compiled mode, CUDA timings and memory) read "skipped: no GPU".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PASS, FAIL, SKIP, INFO, UNSUPPORTED = "PASS", "FAIL", "SKIP", "INFO", "UNSUPPORTED"
NO_GPU = "skipped: no GPU"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    default=os.environ.get("GPU_CHECK_CPU_DRY_RUN", "0") not in ("", "0"),
                    help="exercise the plumbing on CPU (Triton interpreter, tiny sizes); also GPU_CHECK_CPU_DRY_RUN=1")
    ap.add_argument("--budget", type=float, default=260.0,
                    help="seconds; checks that would start later are skipped (default 260)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (default 20 GPU, 2 CPU)")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the checks whose name has one")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--markdown", default="", help="also write the table as Markdown to this file")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.cpu_dry_run:
    # Both must be set before torch / triton are imported: Triton decides at import (decoration)
    # time whether kernels are interpreted, and lightning_tp.kernels reads the variable once.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["TRITON_INTERPRET"] = "1"
elif os.environ.pop("TRITON_INTERPRET", "0") == "1":
    print("gpu_check: TRITON_INTERPRET=1 ignored (it would interpret the kernels on the GPU)", file=sys.stderr)

sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DRY = ARGS.cpu_dry_run
CUDA = torch.cuda.is_available() and not DRY
DEV = torch.device("cuda", 0) if CUDA else torch.device("cpu")
REPS = ARGS.reps or (20 if CUDA else 2)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}
DT_NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ---------------------------------------------------------------------------------------- report

class Report:
    def __init__(self, budget: float):
        self.rows: list[tuple[str, str, str]] = []
        self.t0 = time.perf_counter()
        self.budget = budget

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, check: str, result: str, figure: str = "") -> None:
        self.rows.append((check, result, figure))
        print(f"[{self.elapsed():6.1f}s] {check:34s} {result:11s} {figure}", file=sys.stderr, flush=True)

    @staticmethod
    def wanted(check: str) -> bool:
        return not ARGS.only or any(o in check for o in ARGS.only.split(",") if o)

    def skip(self, check: str, why: str) -> None:
        if self.wanted(check):
            self.add(check, SKIP, why)

    def run(self, check: str, fn, *args, compiled: bool = False) -> None:
        """Run one guarded check; ``fn`` returns (result, figure) or a list of (check, result, figure)."""
        if not self.wanted(check):
            return
        if self.elapsed() > self.budget:
            self.add(check, SKIP, f"skipped: time budget ({self.budget:.0f} s) spent")
            return
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout carries the table alone
                out = fn(*args)
                if CUDA:
                    torch.cuda.synchronize()  # an asynchronous CUDA error belongs to this check
        except Exception as e:  # noqa: BLE001 - one failure must not stop the others
            traceback.print_exc(file=sys.stderr)
            mod = type(e).__module__ or ""
            result = UNSUPPORTED if compiled and mod.startswith(("torch._dynamo", "torch._inductor")) else FAIL
            msg = " ".join(f"{type(e).__name__}: {e}".split())
            self.add(check, result, msg[:200] + ("..." if len(msg) > 200 else ""))
        else:
            if isinstance(out, list):
                for row in out:
                    self.add(*row)
            else:
                self.add(check, *out)
        finally:
            if CUDA:
                with contextlib.suppress(Exception):
                    torch.cuda.empty_cache()

    def table(self) -> str:
        head = ("check", "result", "figure")
        w = [max(len(r[i]) for r in self.rows + [head]) for i in range(3)]
        line = "+-" + "-+-".join("-" * x for x in w) + "-+"
        fmt = lambda r: "| " + " | ".join(c.ljust(x) for c, x in zip(r, w)) + " |"  # noqa: E731
        return "\n".join([line, fmt(head), line, *map(fmt, self.rows), line])

    def markdown(self) -> str:
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        return "\n".join(["| check | result | figure |", "| --- | --- | --- |",
                          *(f"| {esc(a)} | {b} | {esc(c)} |" for a, b, c in self.rows)]) + "\n"


# ---------------------------------------------------------------------------------------- helpers

def sync():
    if CUDA:
        torch.cuda.synchronize()


def median_ms(fn, reps: int = None, warmup: int = 3) -> float:
    """Median wall time of ``fn`` in ms: CUDA events around each call on a GPU, perf_counter on CPU."""
    reps = reps or REPS
    for _ in range(warmup):
        fn()
    sync()
    if CUDA:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in ev:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in ev]
    else:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def peak_extra_bytes(fn):
    """Peak memory ``fn`` allocates above what is allocated before it (None without a GPU)."""
    if not CUDA:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return max(torch.cuda.max_memory_allocated() - base, 1)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|; inf for a non-finite value or a shape mismatch."""
    if got is None or tuple(got.shape) != tuple(ref.shape):
        return math.inf
    g = got.detach().to(ref.device, torch.float64)
    if not torch.isfinite(g).all():
        return math.inf
    d = (g - ref.detach().double()).abs().max().item() if g.numel() else 0.0
    s = ref.detach().double().abs().max().item() if ref.numel() else 0.0
    return d / max(s, 1e-30) if d else 0.0


def fresh(xs, dtype=None):
    """New leaves with the same values (floats optionally cast), keeping which need a gradient."""
    out = []
    for t in xs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            c = t.detach().clone() if dtype is None else t.detach().to(dtype)
            out.append(c.requires_grad_(t.requires_grad))
        else:
            out.append(t)
    return out


def _needs_grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def fwd_bwd(fn, xs, grad):
    """Forward + backward; returns [output, grad of each input that needs one]."""
    out = fn(*xs)
    out.backward(grad.to(out.dtype) if grad is not None else None)
    return [out.detach()] + [x.grad for x in xs if _needs_grad(x)]


def make_step(fn, xs, grad):
    diff = [x for x in xs if _needs_grad(x)]

    def step():
        for x in diff:
            x.grad = None
        fn(*xs).backward(grad)

    return step, diff


def fmt_e(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1e}"


# ---------------------------------------------------------------------------------------- kernels

def kernel_cases():
    """(name, op name in lightning_tp.kernels' warnings, make(shape_kind, dtype), fused, eager, ref).

    ``make`` returns fp32-generated inputs cast to the dtype; tensors that need a gradient are leaves
    with requires_grad. ``ref`` (float64 math on the same values) defaults to ``eager``; ``eager`` is
    what a user writes in PyTorch (also timed). ``eager_baseline=False``: the eager twin is random
    (dropout) and gives no error baseline.
    """
    from lightning_tp import kernels as K

    small = DRY

    def p(*shape, dt, grad=True, scale=1.0):
        return (torch.randn(*shape, device=DEV) * scale).to(dt).requires_grad_(grad)

    def up(x):  # what a user does for norms/losses in 16 bits: compute in fp32 (float64 stays)
        return x if x.dtype == torch.float64 else x.float()

    # check shapes: rows and columns that are not powers of two (masked tails, uneven rows per program),
    # but multiples of 16 where that lets Triton reuse the speed shape's compiled specialization
    rows = lambda kind: (7 if small else 2000) if kind == "check" else (9 if small else 8192)  # noqa: E731
    hid = lambda kind: (33 if small else 3008) if kind == "check" else (32 if small else 4096)  # noqa: E731

    def ln_make(kind, dt):
        n = hid(kind)
        return [p(rows(kind), n, dt=dt), (1 + 0.1 * torch.randn(n, device=DEV)).to(dt).requires_grad_(),
                p(n, dt=dt, scale=0.1)]

    def rms_make(kind, dt):
        n = hid(kind)
        return [p(rows(kind), n, dt=dt), (1 + 0.1 * torch.randn(n, device=DEV)).to(dt).requires_grad_()]

    def rms_eager(x, w):
        xf = up(x)
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def gelu_make(kind, dt):
        n = hid(kind) if kind == "check" else (64 if small else 16384)
        return [p(rows(kind), n, dt=dt), p(n, dt=dt, scale=0.1)]

    def rope_make(kind, dt):
        B, H, T, D = ((1, 2, 5, 8) if small else (2, 5, 300, 64)) if kind == "check" else \
            ((1, 2, 8, 8) if small else (8, 32, 2048, 128))
        pos = torch.arange(T, device=DEV).float()
        inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device=DEV).float() / D)
        emb = torch.cat([pos[:, None] * inv] * 2, -1)
        return [p(B, H, T, D, dt=dt), emb.cos().to(dt), emb.sin().to(dt)]

    def rope_eager(q, cos, sin):
        q1, q2 = q.chunk(2, -1)
        return q * cos + torch.cat((-q2, q1), -1) * sin

    def ce_make(kind, dt):
        n, v = ((7, 50) if small else (2000, 5008)) if kind == "check" else ((9, 64) if small else (8192, 32000))
        t = torch.randint(0, v, (n,), device=DEV)
        t[::7] = -100  # ignored rows
        return [p(n, v, dt=dt, scale=2.0), t]

    return [
        ("layer_norm", "layer_norm", ln_make, lambda x, w, b: K.layer_norm(x, w, b, 1e-5),
         lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5), None, True),
        ("rms_norm", "rms_norm", rms_make, lambda x, w: K.rms_norm(x, w, 1e-6), rms_eager, None, True),
        ("bias_gelu tanh", "bias_gelu", gelu_make, lambda x, b: K.bias_gelu(x, b, "tanh"),
         lambda x, b: F.gelu(x + b, approximate="tanh"), None, True),
        ("bias_gelu exact", "bias_gelu", gelu_make, lambda x, b: K.bias_gelu(x, b, "none"),
         lambda x, b: F.gelu(x + b), None, True),
        ("rotary bhtd", "rotary", rope_make, lambda q, c, s: K.apply_rotary(q, c, s, "bhtd"), rope_eager, None, True),
        ("cross_entropy", "cross_entropy", ce_make, lambda x, t: K.fused_cross_entropy(x, t),
         lambda x, t: F.cross_entropy(up(x), t), None, True),
    ]


@contextlib.contextmanager
def _no_fallback(op: str, what: str):
    """Raise if ``op`` took its PyTorch path inside the block (it warns once per op: forget that first)."""
    from lightning_tp.kernels import _utils
    warned = getattr(_utils, "_WARNED", set())
    warned.discard(op)
    yield
    if op in warned:
        raise RuntimeError(f"{op} fell back to its PyTorch path {what} (see the warning): the kernel was not tested")


def check_correct(dt, make, fused, eager, ref, eager_baseline, op):
    """(worst error of fused over out+grads, same for eager or None, detail) against float64."""
    torch.manual_seed(0)
    xs = make("check", dt)
    with _no_fallback(op, f"for {DT_NAME[dt]}"):
        with torch.no_grad():
            out = fused(*xs)
        g = torch.randn(out.shape, device=DEV).to(out.dtype)  # rounded once: the reference gets the same values
        got = fwd_bwd(fused, fresh(xs), g)
    want = fwd_bwd(ref or eager, fresh(xs, torch.float64), g.double())
    if len(got) != len(want):
        raise RuntimeError(f"fused gave {len(got) - 1} gradients, the reference {len(want) - 1}")
    errs = [rel_err(a, b) for a, b in zip(got, want)]
    e_errs = None
    if eager_baseline:
        e_errs = [rel_err(a, b) for a, b in zip(fwd_bwd(eager, fresh(xs), g), want)]
    return errs, e_errs


def check_kernel(case, dt):
    name, op, make, fused, eager, ref, eager_baseline = case
    errs, e_errs = check_correct(dt, make, fused, eager, ref, eager_baseline, op)
    worst, e_worst = max(errs), (max(e_errs) if e_errs else None)
    ok = worst <= TOL[dt] or (e_worst is not None and worst <= 2 * e_worst)
    fig = f"err out {fmt_e(errs[0])} grad {fmt_e(max(errs[1:], default=0.0))}"
    if e_errs:
        fig += f" (eager {fmt_e(e_errs[0])}/{fmt_e(max(e_errs[1:], default=0.0))})"
    fig += f" tol {TOL[dt]:.0e}"
    fig += "; " + speed_and_memory(make, fused, eager, dt)
    return (PASS if ok else FAIL), fig


def speed_and_memory(make, fused, eager, dt, label="k/e", shape_fn=None):
    """``shape_fn`` (default ``eager``) gives the output whose shape the upstream gradient takes."""
    torch.manual_seed(1)
    xs = make("speed", dt)
    with torch.no_grad():
        out = (shape_fn or eager)(*xs)
        g = torch.randn_like(out) if out.dim() else None  # a scalar loss: backward() with no gradient
        del out
    res = []
    for fn in (fused, eager):
        step, diff = make_step(fn, fresh(xs), g)
        step()  # first call: Triton JIT / autotune / compile, outside the timings
        ms = median_ms(step)
        for x in diff:
            x.grad = None
        mem = peak_extra_bytes(step)
        res.append((ms, mem))
        del step, diff
    (tk, mk), (te, me) = res
    shape = "x".join(map(str, xs[0].shape))
    fig = f"t {label} {tk / te:.2f} ({tk:.3f}/{te:.3f} ms)"
    fig += f", mem {label} {mk / me:.2f}" if mk is not None else ", mem n/a (no GPU)"
    if DRY:
        fig += " [CPU dry run]"
    return fig + f" @{shape}"


def check_compiled(case, dt, dry_plumbing: bool = False):
    """``dry_plumbing``: the CPU dry run's stand-in (dynamo cannot trace the Triton interpreter): the
    kernel's torch path under ``backend="eager"``, which exercises this function, not the kernel."""
    name, op, make, fused, eager, ref, eager_baseline = case
    if dry_plumbing:
        from lightning_tp.kernels import torch_path

        def fused(*xs, _f=fused):  # noqa: F811 - the torch twin stands in for the kernel
            with torch_path():
                return _f(*xs)
    backend = "eager" if dry_plumbing else "inductor"
    cf, ce = torch.compile(fused, dynamic=False, backend=backend), torch.compile(eager, dynamic=False, backend=backend)
    torch.manual_seed(2)
    xs = make("speed", dt)  # one shape: correctness and timing share the compiled graph
    with torch.no_grad():
        out = eager(*xs)  # uncompiled: a no_grad call of the compiled one would compile another graph
    g = torch.randn(out.shape, device=DEV).to(out.dtype)
    with _no_fallback(op, "under torch.compile"):
        got = fwd_bwd(cf, fresh(xs), g)
    want = fwd_bwd(ref or eager, fresh(xs, torch.float64), g.double())
    errs = [rel_err(a, b) for a, b in zip(got, want)]
    e_errs = [rel_err(a, b) for a, b in zip(fwd_bwd(ce, fresh(xs), g), want)] if eager_baseline else None
    worst, e_worst = max(errs), (max(e_errs) if e_errs else None)
    ok = len(got) == len(want) and (worst <= TOL[dt] or (e_worst is not None and worst <= 2 * e_worst))
    fig = f"err {fmt_e(worst)}" + (f" (compiled eager {fmt_e(e_worst)})" if e_errs else "")
    fig += "; " + speed_and_memory(make, cf, ce, dt, label="k/compiled-e", shape_fn=eager)
    return (PASS if ok else FAIL), fig


# ---------------------------------------------------------------------------------------- int8 GEMM

def check_int8_gemm():
    from lightning_tp.quant import int8_linear, int8_matmul

    rows = []
    M, K, N = (17, 40, 33) if DRY else (333, 1000, 517)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (M, K), dtype=torch.int8, generator=g).to(DEV)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g).to(DEV)
    exact = a.double() @ w.double().t()  # exact: |sum| < K * 127**2 << 2**53
    figs, ok = [], True
    backends = ["triton", "int_mm"]
    for be in backends:
        out = int8_matmul(a, w, be)
        good = out.dtype == torch.int32 and torch.equal(out.double(), exact)
        ok &= good
        figs.append(f"{be} {'exact' if good else 'WRONG'}")
    scale = (torch.rand(N, generator=g) * 1e-3 + 1e-4).to(DEV)
    bias = torch.randn(N, generator=g).to(DEV)
    ref = exact * scale.double() + bias.double()
    for dt in ((torch.float32, torch.float16) if DRY else (torch.float32, torch.float16, torch.bfloat16)):
        y = int8_linear(a, w, scale, bias, dt, "triton")
        e = rel_err(y, ref)
        good = y.dtype == dt and e <= TOL[dt]
        ok &= good
        figs.append(f"dequant {DT_NAME[dt]} err {fmt_e(e)}")
    if CUDA:  # the 128x128 tiles of a GEMM that fills the GPU, and an A of over 2**31 elements (int64 offsets)
        for M2, K2, N2 in ((2053, 520, 1800), (2 ** 31 // 2048 + 64, 2048, 64)):
            a2 = torch.randint(-127, 128, (M2, K2), dtype=torch.int8, device=DEV)
            w2 = torch.randint(-127, 128, (N2, K2), dtype=torch.int8, device=DEV)
            good = torch.equal(int8_matmul(a2, w2, "triton"), int8_matmul(a2, w2, "int_mm"))
            ok &= good
            figs.append(f"{M2}x{K2}x{N2} triton {'= int_mm' if good else 'WRONG'}")
            del a2, w2
    rows.append(("int8 GEMM correctness", PASS if ok else FAIL, f"{M}x{K}x{N}: " + ", ".join(figs)))

    # speed: Triton int8 (int32 out, and with the fp16 dequant epilogue), torch._int_mm, fp16 matmul
    M, K, N = (32, 64, 64) if DRY else (8192, 4096, 4096)
    a = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEV)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEV)
    s = torch.rand(N, device=DEV) * 1e-3
    ah, wh = a.half(), w.half()
    if DRY:
        ah, wh = ah.float(), wh.float()  # CPU half matmul is slow or missing; the row is plumbing only
    t_tri = median_ms(lambda: int8_matmul(a, w, "triton"))
    t_deq = median_ms(lambda: int8_linear(a, w, s, None, torch.float16, "triton"))
    try:
        t_int = median_ms(lambda: int8_matmul(a, w, "int_mm"))
    except RuntimeError:
        t_int = math.nan
    t_h = median_ms(lambda: ah @ wh.t())
    ops = 2 * M * K * N / 1e9  # Gop -> Gop/ms = TOP/s
    fig = (f"{M}x{K}x{N}: triton int8 {t_tri:.3f} ms ({ops / t_tri:.3g} TOPS), +dequant {t_deq:.3f} ms, "
           f"torch._int_mm {t_int:.3f} ms, {'fp16' if CUDA else 'fp32 (CPU)'} matmul {t_h:.3f} ms "
           f"({ops / t_h:.3g} TFLOPS); triton/fp16 time {t_tri / t_h:.2f}")
    rows.append(("int8 GEMM speed", INFO, fig + (" [interpreter]" if DRY else "")))
    return rows


# ---------------------------------------------------------------------------------------- GPT step

def _gpt_cfg():
    from examples.gpt.model import GPTConfig
    if DRY:
        return GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    return GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=256)


def _gpt(mode: str):
    from examples.gpt.model import GPT
    from lightning_tp.kernels.inject import apply_kernels
    from lightning_tp.quant import apply_qat

    torch.manual_seed(0)
    model = GPT(_gpt_cfg())
    if mode == "kernels":
        assert apply_kernels(model, True), "apply_kernels replaced nothing"
    elif mode == "int8":
        assert apply_qat(model, "int8"), "apply_qat replaced nothing"
    return model


def _batch(cfg, n=4):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (n, cfg.block_size), generator=g)
    return x, torch.randint(0, cfg.vocab_size, (n, cfg.block_size), generator=g)


def _step(model, device, x, y, reference: bool):
    """loss, {name: grad (float64, CPU)}, loss after one SGD step."""
    from lightning_tp.kernels import torch_path

    model.to(device).train()
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch_path() if reference else contextlib.nullcontext():
        loss = model(x, y)[1]
        loss.backward()
        grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss2 = model(x, y)[1]
    return loss.item(), grads, loss2.item()


def check_gpt_step(mode: str, loss_tol: float, grad_tol: float):
    cfg = _gpt_cfg()
    x, y = _batch(cfg)
    ref_model = _gpt(mode)
    dev_model = copy.deepcopy(ref_model)
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 here
    try:
        l_dev, g_dev, l2_dev = _step(dev_model, DEV, x, y, reference=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    l_ref, g_ref, l2_ref = _step(ref_model, torch.device("cpu"), x, y, reference=True)
    if set(g_dev) != set(g_ref):
        raise RuntimeError(f"different parameters got gradients: {sorted(set(g_dev) ^ set(g_ref))}")
    # per parameter, relative to its own largest gradient but at least 1% of the model's largest: a
    # gradient that is zero in exact math (k_proj.bias: softmax ignores a shift shared by all keys)
    # is rounding noise on both sides, and its "relative" error means nothing
    floor = 1e-2 * max(g.abs().max().item() for g in g_ref.values())
    gerr = {n: rel_err(g_dev[n], g_ref[n]) * max(g_ref[n].abs().max().item(), 1e-30) / max(
        g_ref[n].abs().max().item(), floor) for n in g_ref}
    worst = max(gerr, key=gerr.get)
    dl, dl2 = abs(l_dev - l_ref) / abs(l_ref), abs(l2_dev - l2_ref) / abs(l2_ref)
    ok = dl <= loss_tol and dl2 <= loss_tol and gerr[worst] <= grad_tol
    where = "CPU interpreted vs CPU torch path" if DRY else "GPU vs CPU"
    fig = (f"{where}: loss {l_dev:.5f}/{l_ref:.5f} (rel {fmt_e(dl)}), after SGD rel {fmt_e(dl2)}; "
           f"{len(gerr)} grads, worst {fmt_e(gerr[worst])} ({worst}); tol loss {loss_tol:.0e} grad {grad_tol:.0e}")
    return (PASS if ok else FAIL), fig


def check_expert_layer():
    """The expert-parallel MoE layer (one process: dispatch without exchange) on the device against CPU,
    forward and backward, fp32 with TF32 off; time of one fwd+bwd against the block's own loop."""
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.gpt.model import GPTConfig, MoE
    from lightning_tp.experts.families import family_of
    from lightning_tp.experts.blocks.layer import expert_parallel

    width, tokens = (64, 64) if DRY else (1024, 4096)
    torch.manual_seed(0)
    block = MoE(GPTConfig(n_embd=width, n_expert=8, n_expert_per_token=2))
    layer = expert_parallel(copy.deepcopy(block), family_of(block), None, 1, 0)
    x = torch.randn(1, tokens, width)
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        dev = copy.deepcopy(layer).to(DEV)
        xd = x.detach().clone().to(DEV).requires_grad_(True)
        yd = dev(xd)
        yd.square().mean().backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    xc = x.detach().clone().requires_grad_(True)
    yc = layer(xc)
    yc.square().mean().backward()
    err = max(rel_err(yd.detach().cpu(), yc.detach()), rel_err(xd.grad.cpu(), xc.grad))
    err = max(err, max(rel_err(a.grad.cpu(), b.grad) for a, b in zip(dev.parameters(), layer.parameters())))

    def step(module):
        xx = x.detach().clone().to(DEV).requires_grad_(True)
        module(xx).square().mean().backward()

    own = copy.deepcopy(block).to(DEV)
    t_layer, t_own = median_ms(lambda: step(dev), reps=5), median_ms(lambda: step(own), reps=5)
    ok = err <= 1e-4
    return (PASS if ok else FAIL), (f"{tokens} tokens x {width}, 8 experts top-2: err {fmt_e(err)} (tol 1e-04) "
                                    f"{'GPU vs CPU' if CUDA else 'CPU vs CPU'}; t layer/block loop {t_layer / t_own:.2f}")


def _capture_int8_layers(model):
    """Hooks on every Int8Linear: {layer name: [codes it quantized its input to, its output]}."""
    from lightning_tp.quant import Int8Linear

    seen, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):
            handles.append(m.register_forward_hook(
                lambda mod, inp, out, n=name: seen.__setitem__(n, [mod.quantize_input(inp[0]), out])))
    return seen, handles


def _force_codes(model, codes: dict, own: dict):
    """Each Int8Linear of ``model`` uses the given codes instead of quantizing its input, and records in
    ``own`` the codes it would have made itself."""
    from lightning_tp.quant import Int8Linear

    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):
            def forced(x, m=m, n=name):
                own[n] = Int8Linear.quantize_input(m, x)
                return codes[n].to(x.device)
            m.quantize_input = forced


def check_fused_experts():
    """transformers 5's experts module (3-D weights, its own ``grouped_mm``) behind the expert-parallel
    dispatch (one process: no exchange) against the model's own block on the device: fp32 (TF32 off) error of
    the output and every gradient, and bf16 time of one fwd+bwd against the block's own."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return SKIP, f"transformers {transformers.__version__}: experts are a ModuleList (see the row above)"
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from lightning_tp.experts.blocks.fused import expert_parallel_experts

    width, tokens = (32, 64) if DRY else (1024, 4096)
    config = transformers.MixtralConfig(hidden_size=width, intermediate_size=2 * width, num_local_experts=8,
                                        num_experts_per_tok=2, router_jitter_noise=0.0)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    own = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in own.parameters():
            p.normal_(0, 0.02)
    mine = copy.deepcopy(own)
    expert_parallel_experts(mine.experts, None, 1, 0)
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        outs = []
        for m in (own, mine):
            m = m.to(DEV)
            x = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(1)).to(DEV).requires_grad_(True)
            y = m(x)
            y.square().mean().backward()
            outs.append((y.detach().float().cpu(), x.grad.float().cpu(), [p.grad.float().cpu() for p in m.parameters()]))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    (ya, ga, pa), (yb, gb, pb) = outs
    err = max([rel_err(yb, ya), rel_err(gb, ga)] + [rel_err(b, a) for a, b in zip(pa, pb)])
    times = {}
    for name, m in (("own", own), ("dispatched", mine)):
        m = copy.deepcopy(m).to(DEV, torch.bfloat16 if CUDA else torch.float32)
        xx = torch.randn(1, tokens, width, device=DEV, dtype=next(m.parameters()).dtype)

        def step(m=m, xx=xx):
            x = xx.detach().clone().requires_grad_(True)
            m(x).float().square().mean().backward()

        times[name] = median_ms(step, reps=5)
    ok = err <= 1e-4
    return (PASS if ok else FAIL), (f"Mixtral block, {tokens} tokens x {width}, 8 experts top-2, grouped_mm: err "
                                    f"{fmt_e(err)} (tol 1e-04) vs the block's own; t dispatched/own "
                                    f"{times['dispatched'] / times['own']:.2f} ({'bf16' if CUDA else 'fp32'})")


def check_grouped_experts():
    """The example GPT's ``ModuleList`` experts behind the dispatch as grouped GEMMs (``torch._grouped_mm``)
    against the same layer looping over them: output and gradient error, time of one fwd+bwd (bf16 on GPU)."""
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.gpt.model import GPTConfig, MoE
    from lightning_tp.experts.blocks import layer as ep_layer
    from lightning_tp.experts.families import family_of

    width, tokens = (64, 64) if DRY else (1024, 4096)
    dtype = torch.bfloat16 if CUDA else torch.float32
    torch.manual_seed(0)
    block = MoE(GPTConfig(n_embd=width, n_expert=8, n_expert_per_token=2, bias=False))
    layer = ep_layer.expert_parallel(block, family_of(block), None, 1, 0).to(DEV, dtype)
    x = torch.randn(1, tokens, width, device=DEV, dtype=dtype)
    policy = ep_layer.runs_grouped

    def step(loop: bool):
        ep_layer.runs_grouped = lambda rows: not loop
        try:
            layer.zero_grad()
            xx = x.detach().clone().requires_grad_(True)
            y = layer(xx)
            y.float().square().mean().backward()
            return y.detach().float(), xx.grad.float(), [p.grad.float() for p in layer.parameters()]
        finally:
            ep_layer.runs_grouped = policy

    if ep_layer.grouped_forward(list(layer.experts.values()), x.reshape(-1, width)[:8], [1] * 8) is None:
        return FAIL, f"the experts were not grouped ({dtype} on {DEV})"
    (ya, ga, pa), (yb, gb, pb) = step(True), step(False)
    err = max([rel_err(yb, ya), rel_err(gb, ga)] + [rel_err(b, a) for a, b in zip(pa, pb)])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    t_loop, t_grouped = median_ms(lambda: step(True), reps=5), median_ms(lambda: step(False), reps=5)
    return (PASS if err <= tol else FAIL), (f"{tokens} tokens x {width}, 8 experts top-2, {str(dtype)[6:]}: err "
                                            f"{fmt_e(err)} (tol {tol:.0e}) vs the loop; t grouped/loop "
                                            f"{t_grouped / t_loop:.2f}")


def check_gpt_int8_convert():
    """The converted GPT on the device against CPU, in three parts (see docs/gpu.md): each layer's int8
    GEMM + dequantization on the device's own codes, the codes themselves, the logits on shared codes."""
    from lightning_tp.kernels import torch_path
    from lightning_tp.quant import Int8Linear, convert

    cfg = _gpt_cfg()
    x, y = _batch(cfg)
    model = _gpt("int8")
    with torch.no_grad():
        model.train()
        model(x, y)  # one training forward sets the EMA activation ranges
    model.eval()
    replaced = convert(model)
    dev_model = copy.deepcopy(model).to(DEV)
    for m in dev_model.modules():
        if isinstance(m, Int8Linear):
            m.backend = "triton"  # the CUDA default; in the dry run the interpreted kernel
    seen, handles = _capture_int8_layers(dev_model)
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 here
    try:
        with torch.no_grad():
            got = dev_model(x.to(DEV)).cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
        for h in handles:
            h.remove()
    with torch.no_grad(), torch_path():
        free = model(x)  # the CPU model on its own codes
        own: dict = {}
        _force_codes(model, {n: c for n, (c, _) in seen.items()}, own)
        forced_seen, handles = _capture_int8_layers(model)
        forced = model(x)  # the CPU model on the device's codes
        for h in handles:
            h.remove()
    # (1) each layer on identical codes: the int32 sums are exact, the dequantization acc * scale + bias
    # is the same fp32 arithmetic, at most a fused multiply-add apart: 4 fp32 ulps of the layer's output
    gemm = max(rel_err(out.cpu(), forced_seen[n][1]) for n, (_, out) in seen.items())
    gemm_tol = 4 * torch.finfo(torch.float32).eps
    # (2) the codes: the device's and the CPU's layer inputs differ by fp32 rounding, far below one
    # activation step, so a code may round the other way but never by more than one step
    steps = max(int((own[n].int() - c.cpu().int()).abs().max()) for n, (c, _) in seen.items())
    flips = sum(int((own[n] != c.cpu()).sum()) for n, (c, _) in seen.items())
    codes = sum(c.numel() for c, _ in seen.values())
    # (3) the logits on the same codes: what is left is the fp32 ops between the int8 layers
    e_forced, e_free = rel_err(got, forced), rel_err(got, free)
    ok = gemm <= gemm_tol and steps <= 1 and e_forced <= TOL[torch.float32]
    fig = (f"{len(replaced)} Int8Linear, {'interpreted Triton' if DRY else 'GPU Triton'} vs CPU torch._int_mm: "
           f"layer on same codes err {fmt_e(gemm)} (tol {fmt_e(gemm_tol)}); codes apart by <= {steps} step "
           f"({flips} of {codes} flipped, tol 1 step); logits on same codes err {fmt_e(e_forced)} "
           f"(tol {fmt_e(TOL[torch.float32])}); free-running logits err {fmt_e(e_free)} (not judged: flips propagate)")
    return (PASS if ok else FAIL), fig


# ---------------------------------------------------------------------------------------- NCCL / Trainer

def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def check_nccl():
    import torch.distributed as dist

    from lightning_tp.testing import free_port

    if dist.is_initialized():
        raise RuntimeError("a process group already exists")
    t0 = time.perf_counter()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=DEV)
    try:
        t = torch.arange(4, device=DEV, dtype=torch.float32)
        dist.all_reduce(t)
        b = torch.full((2,), 7.0, device=DEV)
        dist.broadcast(b, 0)
        dist.barrier()
        torch.cuda.synchronize()
        ok = torch.equal(t.cpu(), torch.arange(4.0)) and torch.equal(b.cpu(), torch.full((2,), 7.0))
        backend = dist.get_backend()
    finally:
        dist.destroy_process_group()
    fig = (f"backend {backend}, NCCL {_nccl_version()}, all_reduce + broadcast + barrier ok={ok}, "
           f"{time.perf_counter() - t0:.1f} s")
    return (PASS if ok else FAIL), fig


def check_trainer_fit(steps: int = 4):
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from examples.gpt.lit import LitGPT
    from lightning_tp import MegaStrategy

    cfg = _gpt_cfg()
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, cfg.vocab_size, (steps * 4, cfg.block_size + 1), generator=g)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["backend"] = dist.get_backend() if dist.is_initialized() else "none"
            seen["device"] = str(next(pl_module.parameters()).device)
            seen["fused"] = sum(type(m).__name__.startswith("Fused") for m in pl_module.modules())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.setdefault("losses", []).append(float(outputs["loss"]))

    model = LitGPT(cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, lr=1e-3)
    t0 = time.perf_counter()
    trainer = L.Trainer(accelerator="cpu" if DRY else "gpu", devices=1, strategy=MegaStrategy(tp=1, kernels=True),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Probe()])
    trainer.fit(model, loader)
    losses = seen.get("losses", [])
    want_backend = "gloo" if DRY else "nccl"
    ok = (trainer.global_step == steps and len(losses) == steps and all(map(math.isfinite, losses))
          and seen.get("backend") == want_backend and seen.get("fused", 0) > 0)
    fig = (f"MegaStrategy(tp=1, kernels=True) devices=1 {'cpu [dry run]' if DRY else 'gpu'}: {trainer.global_step} "
           f"steps, backend {seen.get('backend')}, params on {seen.get('device')}, {seen.get('fused')} fused modules, "
           f"loss {losses[0] if losses else math.nan:.3f} -> {losses[-1] if losses else math.nan:.3f}, "
           f"{time.perf_counter() - t0:.1f} s")
    if dist.is_initialized():
        dist.destroy_process_group()
    return (PASS if ok else FAIL), fig


def _train_row(fn, ctx, *args):
    ok, fig = fn(ctx, *args)
    return (PASS if ok else FAIL), fig


# ---------------------------------------------------------------------------------------- main

def env_row():
    import triton
    parts = [f"torch {torch.__version__}", f"triton {triton.__version__}"]
    if CUDA:
        p = torch.cuda.get_device_properties(DEV)
        parts += [f"CUDA {torch.version.cuda}", f"{p.name} ({p.multi_processor_count} SMs, "
                  f"{p.total_memory / 2**30:.0f} GiB)", f"NCCL {_nccl_version()}"]
    else:
        parts += ["CPU dry run: TRITON_INTERPRET=1, tiny sizes"]
    from lightning_tp import kernels as K
    parts.append(f"kernels INTERPRET={K.INTERPRET}")
    return INFO, ", ".join(parts)


def main() -> int:
    import logging
    import warnings

    if not torch.cuda.is_available() and not DRY:
        print(f"gpu_check: no CUDA GPU visible to torch {torch.__version__} (a CPU build has no CUDA); run with "
              f"--cpu-dry-run to exercise the plumbing on CPU, or use a Python whose torch is a CUDA build "
              f"(PYTHON=... bench/gpu_check.sh).", file=sys.stderr)
        return 2
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*TF32.*")

    rep = Report(ARGS.budget)
    rep.run("env", env_row)
    cases = kernel_cases()
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    for case in cases:
        for dt in dtypes:
            check = f"kernel {case[0]} {DT_NAME[dt]}"
            if dt is torch.bfloat16 and not CUDA:
                rep.skip(check, NO_GPU + " (the interpreter's bf16 math is wrong; bf16 runs compiled only)")
                continue
            rep.run(check, check_kernel, case, dt)
    rep.run("int8 GEMM", check_int8_gemm)
    rep.run("gpt step kernels=True", check_gpt_step, "kernels", 1e-5, 2e-4)
    rep.run("gpt step quant=int8", check_gpt_step, "int8", 1e-3, 2e-2)
    rep.run("gpt int8 convert", check_gpt_int8_convert)
    if CUDA:
        rep.run("nccl init (1 process)", check_nccl)
    else:
        rep.skip("nccl init (1 process)", NO_GPU + " (2-process NCCL needs 2 GPUs; not run at all)")
    rep.run("trainer fit MegaStrategy(tp=1)", check_trainer_fit)
    from bench import gpu_check_train as train  # the Trainer rows: fits on the device against a reference fit there
    ctx = train.Ctx(_gpt_cfg(), DEV, DRY, steps=2 if DRY else 4)
    for check, (fn, args) in train.ROWS.items():
        rep.run(check, _train_row, fn, ctx, *args)
    rep.run("expert layer (MoE, ep=1)", check_expert_layer)
    for i, case in enumerate(cases):
        check = f"compiled {case[0]} bf16"
        if not CUDA and i == 0 and not ARGS.no_compile:  # the plumbing only: torch path, eager backend
            rep.run(f"compiled {case[0]} fp32 [dry run]", check_compiled, case, torch.float32, True)
            rep.skip(check, NO_GPU)
        elif not CUDA:
            rep.skip(check, NO_GPU)
        elif ARGS.no_compile:
            rep.skip(check, "skipped: --no-compile")
        else:
            rep.run(check, check_compiled, case, torch.bfloat16, compiled=True)
    rep.run("grouped expert GEMM (ModuleList experts)", check_grouped_experts)
    rep.run("hf 5.x experts (grouped_mm) dispatched", check_fused_experts)
    from bench import gpu_check_cp as cpc  # context parallelism: the ring in threads, the block kernels
    rep.run("cp ring (cp=4 threads)", cpc.check_ring, DEV, DRY, rel_err, fmt_e, median_ms)
    rep.run("cp ring speed", cpc.check_speed, DEV, DRY, median_ms)
    rep.run("cp blocks", cpc.check_blocks, DEV, DRY, rel_err, fmt_e)
    counts = {k: sum(r[1] == k for r in rep.rows) for k in (PASS, FAIL, SKIP, UNSUPPORTED)}
    rep.add("total", FAIL if counts[FAIL] else PASS,
            f"{rep.elapsed():.1f} s wall; {counts[PASS]} pass, {counts[FAIL]} fail, {counts[SKIP]} skipped, "
            f"{counts[UNSUPPORTED]} unsupported")

    print(rep.table())
    print("t k/e: kernel / eager time of one fwd+bwd (median of %d%s; < 1 = kernel faster); mem k/e: peak extra "
          "memory kernel / eager; err: max |x - ref| / max |ref| vs float64, over the output and every gradient."
          % (REPS, " CUDA-event timings after warm-up" if CUDA else " CPU timings, interpreter: not a speed"))
    if ARGS.markdown:
        Path(ARGS.markdown).write_text(rep.markdown())
    return 1 if counts[FAIL] else 0


if __name__ == "__main__":
    sys.exit(main())
