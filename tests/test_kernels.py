"""Fused kernels vs plain-PyTorch references, forward and backward.

The Triton kernels run on CPU tensors in the Triton interpreter (TRITON_INTERPRET=1, set before
anything imports triton). The interpreter's bf16 arithmetic is wrong, so only fp32 and fp16 are
tested here; bf16 is exercised only as the dtype the interpreter path refuses (with a warning).
References are written independently of the package (F.layer_norm, torch.softmax, F.gelu, ...).
Shapes are tiny because every interpreted program instance costs milliseconds.

Triton reads TRITON_INTERPRET when it is first imported (lightning imports it), so
``tests/conftest.py`` sets it before anything else; the kernels' dispatch flag is switched on only
while these tests run, so other test modules keep the plain torch path on CPU.
"""

import os
import sys


def _triton_interpreted():
    """None: triton not imported yet; else whether it was imported in interpreter mode."""
    rnd = sys.modules.get("triton.language.random")
    return None if rnd is None else type(rnd.rand).__name__ == "InterpretedFunction"


_ENV_BEFORE = os.environ.get("TRITON_INTERPRET")
if _triton_interpreted() is None:
    os.environ["TRITON_INTERPRET"] = "1"  # before importing triton / lightning_tp.kernels

import warnings  # noqa: E402
from datetime import timedelta  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from dist import free_port  # noqa: E402
from lightning_tp import kernels as K  # noqa: E402
from lightning_tp.kernels import _utils  # noqa: E402
from lightning_tp.kernels import cross_entropy as ce_mod  # noqa: E402

INTERPRETED = bool(_triton_interpreted()) and K.INTERPRET
if _ENV_BEFORE is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _ENV_BEFORE
_utils.INTERPRET = _ENV_BEFORE == "1" and K.INTERPRET  # switched on only while this module runs

FP = [torch.float32, torch.float16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def _leaf(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype).requires_grad_()


def _check(out, ref, dtype, what=""):
    assert out.dtype == ref.dtype, what
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _grads(y, inputs, dy):
    return torch.autograd.grad(y, inputs, dy)


@pytest.fixture(scope="module", autouse=True)
def _interpreter_for_this_module():
    mp = pytest.MonkeyPatch()
    if INTERPRETED:
        mp.setenv("TRITON_INTERPRET", "1")  # triton imports parts of itself lazily and checks it then
        mp.setattr(_utils, "INTERPRET", True)
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _seed(request):
    assert INTERPRETED, ("triton was imported in compiled mode before TRITON_INTERPRET=1 was set; "
                         "tests/conftest.py must set it before anything imports lightning or triton")
    torch.manual_seed(0)


def test_interpreter_is_active():
    assert K.INTERPRET and K.HAS_TRITON
    x = torch.randn(2, 8)
    assert _utils.use_triton("probe", x)


# --------------------------------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype", FP)
def test_layer_norm(dtype):
    x, w, b = _leaf(3, 4, 37, dtype=dtype), _leaf(37), _leaf(37)
    y = K.layer_norm(x, w, b, 1e-5)
    dy = torch.randn_like(y)
    g = _grads(y, (x, w, b), dy)
    ref = F.layer_norm(x.float(), (37,), w, b, 1e-5)
    gr = _grads(ref, (x, w, b), dy.float())
    _check(y, ref.to(dtype), dtype, "y")
    for a, r, n in zip(g, gr, "xwb"):
        _check(a, r, dtype, f"d{n}")


@pytest.mark.parametrize("dtype", FP)
def test_rms_norm(dtype):
    x, w = _leaf(3, 4, 37, dtype=dtype), _leaf(37)
    y = K.rms_norm(x, w, 1e-6)
    dy = torch.randn_like(y)
    g = _grads(y, (x, w), dy)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    gr = _grads(ref, (x, w), dy.float())
    _check(y, ref.to(dtype), dtype, "y")
    for a, r, n in zip(g, gr, "xw"):
        _check(a, r, dtype, f"d{n}")


def test_norms_noncontiguous_input():
    x = torch.randn(37, 6).t().requires_grad_()  # (6, 37) view with column stride 6
    assert not x.is_contiguous()
    w, b = _leaf(37), _leaf(37)
    for y, ref in [(K.layer_norm(x, w, b), F.layer_norm(x, (37,), w, b)),
                   (K.rms_norm(x, w, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)]:
        dy = torch.randn_like(y)
        _check(y, ref, torch.float32, "y")
        for a, r in zip(_grads(y, (x, w), dy), _grads(ref, (x, w), dy)):
            _check(a, r, torch.float32, "grad")


def test_norm_modules_take_over_parameters():
    ln = nn.LayerNorm(37)
    nn.init.normal_(ln.weight), nn.init.normal_(ln.bias)
    fln = K.FusedLayerNorm.from_module(ln)
    assert fln.weight is ln.weight and fln.bias is ln.bias
    assert fln.state_dict().keys() == ln.state_dict().keys()
    x = torch.randn(4, 37)
    _check(fln(x), ln(x), torch.float32, "FusedLayerNorm")

    class HFRMSNorm(nn.Module):  # the HF LlamaRMSNorm interface
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n))
            self.variance_epsilon = 1e-3

        def forward(self, h):
            return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    for m in (HFRMSNorm(37), nn.RMSNorm(37, eps=1e-3)):
        fr = K.FusedRMSNorm.from_module(m)
        assert fr.weight is m.weight and fr.state_dict().keys() == m.state_dict().keys()
        _check(fr(x), m(x), torch.float32, type(m).__name__)


# ---------------------------------------------------------------------------------------- gelu
@pytest.mark.parametrize("dtype,approx", [(torch.float32, "tanh"), (torch.float32, "none"), (torch.float16, "tanh")])
def test_bias_gelu(dtype, approx):
    x, b = _leaf(3, 37, dtype=dtype, scale=2), _leaf(37)
    y = K.bias_gelu(x, b, approx)
    ref = F.gelu(x.float() + b, approximate=approx)
    dy = torch.randn_like(y)
    _check(y, ref.to(dtype), dtype, "y")
    for a, r, n in zip(_grads(y, (x, b), dy), _grads(ref, (x, b), dy.float()), "xb"):
        _check(a, r, dtype, f"d{n}")


def test_gelu_module_from_nn_gelu_noncontiguous():
    m = K.FusedBiasGeLU.from_module(nn.GELU(approximate="tanh"))
    x = torch.randn(37, 5).t()
    _check(m(x), F.gelu(x, approximate="tanh"), torch.float32, "module")
    assert K.FusedBiasGeLU.from_module(nn.GELU()).approximate == "none"


# -------------------------------------------------------------------------------------- rotary
def _rope_ref(x_bhtd, cos, sin):
    x1, x2 = x_bhtd.float().chunk(2, -1)
    c, s = cos.float().unsqueeze(-3), sin.float().unsqueeze(-3)  # broadcast over heads
    return x_bhtd.float() * c + torch.cat((-x2, x1), -1) * s


def _cos_sin(B, T, D, batched):
    pos = torch.arange(T)[None].expand(B, T) + torch.randint(0, 5, (B, 1)) if batched else torch.arange(T)[None]
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([pos[..., None] * inv] * 2, -1)
    cos, sin = emb.cos(), emb.sin()
    return (cos, sin) if batched else (cos[0], sin[0])


@pytest.mark.parametrize("dtype,layout,batched", [(torch.float32, "bhtd", True), (torch.float32, "bthd", False),
                                                  (torch.float16, "bhtd", False)])
def test_rotary(dtype, layout, batched):
    B, H, T, D = 2, 3, 5, 12
    q = _leaf(B, H, T, D, dtype=dtype)
    cos, sin = _cos_sin(B, T, D, batched)
    inp = q if layout == "bhtd" else q.transpose(1, 2)  # the bthd case is a non-contiguous view
    y = K.apply_rotary(inp, cos, sin, layout)
    y_bhtd = y if layout == "bhtd" else y.transpose(1, 2)
    ref = _rope_ref(q, cos, sin)
    dy = torch.randn_like(y_bhtd)
    _check(y_bhtd, ref.to(dtype), dtype, "y")
    _check(_grads(y_bhtd, (q,), dy)[0], _grads(ref, (q,), dy.float())[0], dtype, "dq")


def test_rotary_q_and_k():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    cos, sin = _cos_sin(1, 4, 8, False)
    qo, ko = K.apply_rotary_pos_emb(q, k, cos, sin)
    _check(qo, _rope_ref(q, cos, sin), torch.float32, "q")
    _check(ko, _rope_ref(k, cos, sin), torch.float32, "k")


# ------------------------------------------------------------------------------- cross-entropy
@pytest.fixture
def small_block(monkeypatch):
    monkeypatch.setattr(ce_mod, "MAX_BLOCK", 32)  # V=101 -> 4 blocks: exercises the online rescale


@pytest.mark.parametrize("dtype", FP)
def test_cross_entropy(dtype, small_block):
    N, V = 7, 101
    big = torch.randn(N, V + 9) * 3
    tgt = torch.randint(0, V, (N,))
    tgt[[1, 4]] = -100
    for reduction, chunk, inplace in [("mean", None, False), ("sum", 3, False), ("none", None, True)]:
        x = big[:, 4:4 + V].to(dtype).requires_grad_()  # fp32: a view with row stride V + 9
        # in-place backward overwrites its input buffer, so hand it a temporary nothing else reads
        inp = x * 1.0 if inplace else x
        loss = K.fused_cross_entropy(inp, tgt, reduction=reduction, chunk_tokens=chunk, inplace_backward=inplace)
        xr = x.detach().float().requires_grad_()
        ref = F.cross_entropy(xr, tgt, reduction=reduction)
        dl = torch.rand_like(ref) if reduction == "none" else torch.tensor(1.7)
        _check(loss, ref, dtype, reduction)  # the loss is fp32 for 16-bit logits, as F.cross_entropy's
        (g,) = _grads(loss, (x,), dl)
        (gr,) = _grads(ref, (xr,), dl)
        _check(g, gr.to(dtype), dtype, f"grad {reduction}")
        assert torch.equal(g[1], torch.zeros_like(g[1]))  # ignored row


def test_cross_entropy_transposed_and_all_ignored(small_block):
    logits = torch.randn(101, 5).t().requires_grad_()  # column stride != 1
    tgt = torch.tensor([3, 100, 0, -100, 57])
    loss = K.fused_cross_entropy(logits, tgt)
    ref = F.cross_entropy(logits, tgt)
    _check(loss, ref, torch.float32, "loss")
    _check(_grads(loss, (logits,), None)[0], _grads(ref, (logits,), None)[0], torch.float32, "grad")
    all_ign = torch.full((5,), -100)
    assert torch.isnan(K.fused_cross_entropy(logits, all_ign)) and torch.isnan(F.cross_entropy(logits, all_ign))
    assert K.fused_cross_entropy(logits, all_ign, reduction="sum") == 0


def test_cross_entropy_module_from_module():
    src = nn.CrossEntropyLoss(ignore_index=0, reduction="sum")
    m = K.FusedCrossEntropyLoss.from_module(src)
    logits, tgt = torch.randn(4, 10), torch.tensor([0, 3, 9, 2])
    _check(m(logits, tgt), src(logits, tgt), torch.float32, "module")
    assert m.state_dict().keys() == src.state_dict().keys()


def _ce_worker(rank, world, port, shards):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        _utils.INTERPRET = INTERPRETED  # this fresh process imported triton in interpreter mode
        ce_mod.MAX_BLOCK = 32
        torch.manual_seed(0)  # identical full logits / targets on both ranks
        full = torch.randn(6, shards[-1]) * 3
        tgt = torch.randint(0, shards[-1], (6,))
        tgt[2] = -100
        lo, hi = shards[rank], shards[rank + 1]
        ref_logits = full.clone().requires_grad_()
        ref = F.cross_entropy(ref_logits, tgt)
        ref.backward()
        for path in ("triton", "torch"):
            local = full[:, lo:hi].clone().requires_grad_()
            if path == "torch":
                with K.torch_path():
                    loss = K.fused_cross_entropy(local, tgt, vocab_start=lo, group=dist.group.WORLD)
            else:
                loss = K.fused_cross_entropy(local, tgt, vocab_start=lo, group=dist.group.WORLD)
            loss.backward()
            width = max(b - a for a, b in zip(shards, shards[1:]))
            padded = F.pad(local.grad, (0, width - (hi - lo)))
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded)
            grad = torch.cat([p[:, : shards[i + 1] - shards[i]] for i, p in enumerate(parts)], 1)
            torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5, msg=f"{path} loss")
            torch.testing.assert_close(grad, ref_logits.grad, atol=1e-5, rtol=1e-5, msg=f"{path} grad")
    finally:
        dist.destroy_process_group()


def test_cross_entropy_vocab_parallel_gloo():
    torch.multiprocessing.spawn(_ce_worker, args=(2, free_port(), (0, 51, 101)), nprocs=2, join=True)


# ------------------------------------------------------------------------------------ dispatch
@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_utils, "_WARNED", set())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_unsupported_dtype_falls_back_with_one_warning(dtype, fresh_warnings):
    x, w, b = torch.randn(3, 37, dtype=dtype), torch.randn(37, dtype=dtype), torch.randn(37, dtype=dtype)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y1 = K.layer_norm(x, w, b)
        y2 = K.layer_norm(x, w, b)
    msgs = [str(r.message) for r in rec if "lightning_tp.kernels" in str(r.message)]
    assert len(msgs) == 1 and "layer_norm" in msgs[0] and str(dtype) in msgs[0]
    ref = F.layer_norm(x.float(), (37,), w.float(), b.float()).to(dtype)
    assert torch.equal(y1, y2)
    torch.testing.assert_close(y1, ref)


def test_plain_cpu_uses_torch_path_silently(monkeypatch, fresh_warnings):
    monkeypatch.setattr(_utils, "INTERPRET", False)
    x = torch.randn(2, 37)
    assert not _utils.use_triton("probe", x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = K.rms_norm(x, torch.ones(37), 1e-6)
    _check(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), torch.float32, "rms")
