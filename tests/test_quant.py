"""QAT (lightning_tp.quant): fake quant vs hand references, STE gradients, int8 GEMM exactness,
int8 layers vs fake quant, calibration, apply_qat on the example GPT, and tp=2 parity (one launch)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dist as launch
from examples.gpt.model import GPT, GPTConfig
from lightning_tp.marks import marks_of
from lightning_tp.quant import (QUANT_MODES, ActQuantizer, Int8Linear, QATColumnParallelLinear, QATLinear,
                                QATRowParallelLinear, apply_qat, calibrate, convert, fake_quant_weight, int8_matmul)


def _ref_weight_fq(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Row by row, as the textbook writes it: s = max|w_i| / qmax, q = clamp(round(w * (1 / s))) * s
    (multiplying by the inverse scale, as PyTorch's fake-quant ops and int8 kernels do)."""
    q = 2 ** (bits - 1) - 1
    out = torch.empty_like(w)
    for i in range(w.shape[0]):
        s = w[i].abs().max() / q
        out[i] = torch.clamp(torch.round(w[i] * (1 / s)), -q, q) * s
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_fake_quant_matches_reference_and_passes_gradient(bits):
    torch.manual_seed(0)
    w = torch.randn(12, 20, requires_grad=True)
    y = fake_quant_weight(w, bits)
    ref = _ref_weight_fq(w.detach(), bits)
    assert torch.equal(y, ref)
    q = 2 ** (bits - 1) - 1
    codes = ref / (w.detach().abs().amax(1, keepdim=True) / q)
    assert codes.abs().amax(1).sub(q).abs().max() < 1e-4  # every row reaches its grid's end
    assert len(torch.unique(y[0])) <= 2 * q + 1
    g = torch.randn_like(w)
    y.backward(g)
    assert torch.equal(w.grad, g)  # STE: absmax scales never clip a weight


def test_activation_fake_quant_reference_and_ste_mask():
    q = ActQuantizer(bits=8).eval()
    amax = 1.5
    q._set_range(torch.tensor(amax))
    x = (torch.randn(6, 10) * 1.2).requires_grad_()
    y = q(x)
    s = torch.tensor(amax / 127)
    inv = 1 / s
    codes = [[max(-127, min(127, round(float(torch.tensor(v) * inv)))) for v in row] for row in x.detach().tolist()]
    assert torch.equal(y, torch.tensor(codes) * s)
    clipped = torch.tensor(codes).abs() < (x.detach() * inv).round().abs()
    assert clipped.any() and (x.detach().abs() <= amax).any()  # some values are clipped...
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, g * ~clipped)  # ...and get no gradient; the rest passes through


def test_ema_range_updates_in_training_and_freezes_in_eval():
    q = ActQuantizer(bits=8, momentum=0.9)
    a, b = torch.randn(4, 8), torch.randn(4, 8) * 3
    q.train()
    q(a)
    assert q.amax.item() == pytest.approx(a.abs().max().item())  # first batch: the batch's own range
    q(b)
    expected = 0.9 * a.abs().max().item() + 0.1 * b.abs().max().item()
    assert q.amax.item() == pytest.approx(expected, rel=1e-6)
    q.eval()
    y = q(b * 10)
    assert q.amax.item() == pytest.approx(expected, rel=1e-6)
    assert y.abs().max().item() == pytest.approx(expected, rel=1e-5)  # clipped at the frozen range


def test_delayed_range_folds_the_steps_max_after_the_optimizer_step():
    q, w = ActQuantizer(bits=8, range_mode="delayed", momentum=0.9), nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.1)
    a, b, c = torch.randn(4, 8), torch.randn(4, 8) * 3, torch.randn(4, 8) * 2
    q.train()
    assert torch.equal(q(a), a) and not q.is_initialized  # first step: no range yet, x passes
    assert torch.equal(q(b), b)  # a second microbatch of the same step
    opt.step()  # folds: the step's range is the max over its microbatches, as one batch would see
    first = max(a.abs().max().item(), b.abs().max().item())
    assert q.amax.item() == pytest.approx(first)
    y = q(c)  # the next step quantizes with the range as of the last step, not c's
    assert y.abs().max().item() <= first * (1 + 1e-6) and not torch.equal(y, c)
    assert q.amax.item() == pytest.approx(first)
    opt.step()
    assert q.amax.item() == pytest.approx(0.9 * first + 0.1 * c.abs().max().item(), rel=1e-6)
    # what a step saw does not travel with a copy or survive loading a state dict; overflow is ignored
    settled = q.amax.item()
    q(c * 100)
    twin = copy.deepcopy(q)
    q.load_state_dict(twin.state_dict())
    q(torch.full((2, 2), float("inf")))
    opt.step()
    assert q.amax.item() == twin.amax.item() == pytest.approx(settled)


def test_delayed_range_folds_only_with_the_optimizer_of_its_layer():
    """Two models, two optimizers (a GAN's generator and critic): each step folds its own layers'
    ranges; a layer whose optimizer never stepped says so when its scale is asked for."""
    torch.manual_seed(0)
    gen, critic = (QATLinear.from_linear(nn.Linear(8, 8), range_mode="delayed") for _ in range(2))
    opt_g, opt_c = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(critic.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    gen(x), critic(x * 2)
    opt_c.step()
    assert critic.act_quant.amax.item() == pytest.approx(2 * x.abs().max().item())
    assert not gen.act_quant.is_initialized  # the critic's step is not the generator's
    with pytest.raises(RuntimeError, match="never folded: it folds after optimizer.step"):
        gen.act_quant.scale()
    opt_g.step()
    assert gen.act_quant.amax.item() == pytest.approx(x.abs().max().item())
    frozen = QATLinear.from_linear(nn.Linear(8, 8).requires_grad_(False), range_mode="delayed")
    frozen(x)
    opt_g.step()  # a frozen layer is in no optimizer: any step folds it
    assert frozen.act_quant.amax.item() == pytest.approx(x.abs().max().item())


def test_quant_range_needs_quant():
    from lightning_tp import MegaStrategy

    with pytest.raises(ValueError, match="needs quant="):
        MegaStrategy(quant_range="delayed")
    with pytest.raises(ValueError, match="choose one of"):
        MegaStrategy(quant="int8", quant_range="minmax")


def test_learned_clip_gradient_matches_lsq_formula():
    torch.manual_seed(1)
    q = ActQuantizer(bits=8, range_mode="learned").train()
    x = torch.randn(5, 7) * 2
    q._set_range(torch.tensor(2.5))
    g = torch.randn(5, 7)
    q(x).backward(g)
    s, Q = 2.5 / 127, 127
    v = x / s
    inside = v.abs() <= Q
    d = torch.where(inside, (torch.round(v) - v) / Q, torch.sign(v))
    expected = (g * d).sum() / (x.numel() * Q) ** 0.5
    assert (~inside).any()
    assert q.clip.grad.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("backend", ["int_mm", "padded", "triton"])
@pytest.mark.parametrize("shape", [(3, 5, 7), (17, 64, 48), (40, 70, 33)])
def test_int8_matmul_is_exact(backend, shape):
    M, K, N = shape
    g = torch.Generator().manual_seed(M * K * N)
    a = torch.randint(-127, 128, (M, K), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    out = int8_matmul(a, w, backend)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), a.long() @ w.long().t())


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("mode", ["int8", "w4a8"])
def test_converted_linear_equals_integer_reference_and_fake_quant(mode, backend):
    torch.manual_seed(2)
    w_bits, a_bits = QUANT_MODES[mode]
    layer = QATLinear.from_linear(nn.Linear(24, 40), w_bits, a_bits).train()
    for _ in range(3):  # set the EMA range
        layer(torch.randn(2, 9, 24))
    layer.eval()
    x = torch.randn(2, 9, 24) * 1.3
    y_fq = layer(x)
    # integer reference, from the definitions (not from the layer's helpers)
    qa, qw = 2 ** (a_bits - 1) - 1, 2 ** (w_bits - 1) - 1
    s_a = layer.act_quant.amax / qa
    s_w = layer.weight.detach().abs().amax(1) / qw
    xq = torch.clamp(torch.round(x.reshape(-1, 24) * (1 / s_a)), -qa, qa).long()
    wq = torch.clamp(torch.round(layer.weight.detach() * (1 / s_w[:, None])), -qw, qw).long()
    acc = xq @ wq.t()
    int8 = Int8Linear.from_qat(layer)
    int8.backend = backend
    assert torch.equal(int8.weight_int8.long(), wq)
    assert torch.equal(int8.quantize_input(x).long(), xq)
    assert torch.equal(int8_matmul(int8.quantize_input(x), int8.weight_int8, backend).long(), acc)
    y = int8(x)
    ref = (acc.double() * (s_a * s_w).double() + layer.bias.detach().double()).reshape(2, 9, 40)
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-6)
    step = (s_a * s_w.max()).item()  # one step of the output grid
    assert (y - y_fq).abs().max().item() <= step
    # the QAT layer multiplies the same integer codes and scales them the same way: equal, not close
    assert torch.equal(y, y_fq)


def test_apply_qat_on_gpt_modes_skips_and_state_dict():
    with pytest.raises(ValueError, match=r"unknown quantization mode 'int3'.*\['int8', 'w4a8'\]"):
        apply_qat(GPT(GPTConfig()), "int3")
    with pytest.raises(ValueError, match="ema"):
        apply_qat(GPT(GPTConfig()), "int8", act_range="minmax")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32))
    fp32_state = copy.deepcopy(model.state_dict())
    replaced = apply_qat(model, "w4a8")
    assert len(replaced) == 2 * 6  # q, k, v, o, fc, proj per block; lm_head and embeddings kept
    assert type(model.lm_head) is nn.Linear and type(model.transformer.wte) is nn.Embedding
    assert set(fp32_state) <= set(model.state_dict())
    model.load_state_dict(fp32_state)  # an fp32 checkpoint still loads (ranges start unset)
    assert not model.transformer.h[0].mlp.c_fc.act_quant.is_initialized
    whole = apply_qat(GPT(GPTConfig(n_layer=1, n_embd=32)), "int8", skip_lm_head=False, skip=["transformer.h.0.attn"])
    assert "lm_head" in whole and not any(k.startswith("transformer.h.0.attn") for k in whole)


def test_calibrate_sets_mean_absmax_without_training():
    torch.manual_seed(3)
    fp32 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = copy.deepcopy(fp32)
    apply_qat(model, "int8")
    batches = [torch.randn(5, 8) * (i + 1) for i in range(3)]
    seen = {0: [], 2: []}
    hooks = [fp32[i].register_forward_pre_hook(lambda m, a, i=i: seen[i].append(a[0].abs().max().item())) for i in seen]
    outs = [fp32(b) for b in batches]
    for h in hooks:
        h.remove()
    before = copy.deepcopy(model.state_dict())
    got = []
    assert calibrate(model, batches, forward=lambda m, b: got.append(m(b))) == 3
    for i in seen:
        assert model[i].act_quant.amax.item() == pytest.approx(sum(seen[i]) / 3, rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, outs))  # observe-only: the fp32 forward
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if "act_quant" not in k)
    assert model.training and model[0].weight.grad is None


# ------------------------------------------------------------------ tensor parallel (one launch)

CASES = [("int8", "ema", False, "adamw"), ("w4a8", "learned", True, "sgd")]


def _parity_case(rank, mesh, mode, act_range, sp, opt_name):
    import torch.distributed as dist

    from lightning_tp import comm
    from lightning_tp.layers.linear import ColumnParallelLinear, RowParallelLinear, TPContext

    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
    data = [(torch.randn(4, 8, 16), torch.randn(4, 8, 16)) for _ in range(11)]
    ref = nn.Sequential(copy.deepcopy(fc1), nn.GELU(), copy.deepcopy(fc2))
    apply_qat(ref, mode, act_range=act_range)
    ctx = TPContext(group=mesh.tp_group, world=2, rank=rank, sp=sp, seq_dim=1)
    memo, c1, c2 = {}, copy.deepcopy(fc1), copy.deepcopy(fc2)  # kept alive: the memo is keyed by id()
    if sp:  # straight from the user's Linear
        w_bits, a_bits = QUANT_MODES[mode]
        kw = dict(w_bits=w_bits, a_bits=a_bits, range_mode=act_range)
        tp = nn.Sequential(QATColumnParallelLinear.from_linear(c1, ctx, "0", memo, **kw), nn.GELU(),
                           QATRowParallelLinear.from_linear(c2, ctx, "2", memo, **kw))
    else:  # wrapping the strategy's parallel layers, as MegaStrategy(quant=...) would
        tp = nn.Sequential(ColumnParallelLinear.from_linear(c1, ctx, "0", memo), nn.GELU(),
                           RowParallelLinear.from_linear(c2, ctx, "2", memo))
        assert len(apply_qat(tp, mode, act_range=act_range)) == 2

    def opt(m):
        if opt_name == "adamw":
            return torch.optim.AdamW(m.parameters(), lr=1e-2)
        return torch.optim.SGD(m.parameters(), lr=0.2)

    def local(t):
        return t.chunk(2, dim=1)[rank] if sp else t

    o_ref, o_tp = opt(ref), opt(tp)
    diff = {"loss": 0.0, "out": 0.0, "weights": 0.0, "ranges": 0.0, "first_out": None}
    for x, t in data[:10]:
        y_ref = ref(x)
        loss_ref = F.mse_loss(y_ref, t)
        loss_ref.backward()
        o_ref.step(), o_ref.zero_grad()
        y = tp(local(x))
        loss = ((y - local(t)) ** 2).sum() / t.numel()
        loss.backward()
        for p in tp.parameters():  # what the strategy's sync_gradients does for SP-partial grads
            if marks_of(p).sp_partial:
                dist.all_reduce(p.grad, group=mesh.tp_group)
        o_tp.step(), o_tp.zero_grad()
        total = comm.all_reduce(loss.detach().clone(), mesh.tp_group) if sp else loss.detach()
        diff["loss"] = max(diff["loss"], (total - loss_ref).abs().item())
        diff["out"] = max(diff["out"], (y - local(y_ref)).abs().max().item())
        if diff["first_out"] is None:  # same weights: the integer-code matmul makes tp exact, not close
            diff["first_out"] = (y - local(y_ref)).abs().max().item()
    full1 = comm.all_gather(tp[0].weight.detach(), 0, mesh.tp_group)
    full2 = comm.all_gather(tp[2].weight.detach(), 1, mesh.tp_group)
    diff["weights"] = max((full1 - ref[0].weight).abs().max().item(), (full2 - ref[2].weight).abs().max().item(),
                          (tp[2].bias - ref[2].bias).abs().max().item())
    key = "clip" if act_range == "learned" else "amax"
    ranges = [getattr(tp[i].act_quant, key).item() for i in (0, 2)]
    diff["ranges"] = max(abs(a - getattr(ref[i].act_quant, key).item()) for a, i in zip(ranges, (0, 2)))
    x, _ = data[10]
    ref.eval(), tp.eval()
    diff["eval"] = (tp(local(x)) - local(ref(x))).abs().max().item()
    convert(ref), convert(tp)
    with torch.no_grad():
        diff["int8"] = (tp(local(x)) - local(ref(x))).abs().max().item()
    diff["trained"] = (full1 - fc1.weight).abs().max().item()
    return {"diff": diff, "ranges": ranges, "types": [type(m).__name__ for m in tp]}


def _tp_worker(rank, world):
    import torch.distributed as dist

    from lightning_tp.mesh import build_mesh

    dist.init_process_group("gloo")
    try:
        mesh = build_mesh(tp=2)
        return {case: _parity_case(rank, mesh, *case) for case in CASES}
    finally:
        dist.destroy_process_group()


def test_tp2_qat_matches_single_device():
    results = launch.run(2, _tp_worker)
    for case in CASES:
        r0, r1 = results[0][case], results[1][case]
        assert r0["ranges"] == r1["ranges"], case  # range buffers/params identical on both tp ranks
        assert r0["types"] == ["Int8ColumnParallelLinear", "GELU", "Int8RowParallelLinear"]
        for r in (r0, r1):
            d = r["diff"]
            assert d["trained"] > 1e-3, case  # the runs moved
            for k in ("loss", "out", "weights", "ranges", "eval", "int8"):
                assert d[k] < 1e-5, (case, k, d)
            assert d["first_out"] == 0.0, (case, d)


def test_sixteen_bit_inputs_round_in_fp32():
    torch.manual_seed(4)
    q = ActQuantizer(bits=8).eval()
    q._set_range(torch.tensor(2.0))
    x = torch.randn(64, 32).bfloat16()
    assert q(x).dtype == torch.bfloat16
    assert torch.equal(q(x), q(x.float()).bfloat16())  # codes from fp32 division, as int8 inference


def test_delayed_ranges_reduce_over_ranks_once_per_step_for_all_quantizers(monkeypatch):
    """Under tp/dp a delayed range records the local absmax per microbatch and takes the MAX over
    ranks at the fold: one all-reduce for every quantizer of the step, not one per microbatch."""
    from lightning_tp import comm

    calls = []

    def fake_all_reduce(t, group, op=None):  # the other rank's local absmax is 10 for the first layer
        calls.append((tuple(t.shape), group, op))
        other = torch.zeros_like(t)
        other.view(-1)[0] = 10.0
        return torch.maximum(t, other)

    monkeypatch.setattr(comm, "group_size", lambda g: 1 if g is None else 2)
    monkeypatch.setattr(comm, "all_reduce", fake_all_reduce)
    torch.manual_seed(0)
    layers = [QATLinear.from_linear(nn.Linear(8, 8), range_mode="delayed") for _ in range(3)]
    for layer in layers:
        layer.act_quant.dp_group = "dp"
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.1)
    micro = [torch.randn(4, 8) * (k + 1) for k in range(4)]
    for x in micro:
        for layer in layers:
            layer(x)
    assert calls == []  # nothing reduced per microbatch
    opt.step()
    assert [shape for shape, _, _ in calls] == [(3,)] and calls[0][1] == "dp"  # one, for all three
    local = max(x.abs().max().item() for x in micro)
    assert layers[0].act_quant.amax.item() == pytest.approx(max(local, 10.0))
    assert [layer.act_quant.amax.item() for layer in layers[1:]] == [pytest.approx(local)] * 2
