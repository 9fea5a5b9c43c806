"""kernels=True swaps modules in place and trains the same numbers; here through the real Triton
kernels (the interpreter, which tests/conftest.py enables), on a model small enough for it."""

import pytest
import torch

from examples.gpt.model import GPT, GPTConfig
from lightning_tp.kernels import _utils
from lightning_tp.kernels.inject import KERNELS, apply_kernels, kernel_names


def _train(kernels: bool, steps: int = 2):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    if kernels:
        assert sorted(apply_kernels(model, True)) == sorted(
            ["transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.0.mlp.act", "transformer.ln_f",
             "loss_fn"])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(x, x.roll(-1, 1))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, model.state_dict()


def test_fused_modules_train_like_the_originals(monkeypatch):
    monkeypatch.setattr(_utils, "INTERPRET", True)  # run the Triton kernels, not their torch twins
    ref_losses, ref_state = _train(False)
    losses, state = _train(True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0)
    assert set(state) == set(ref_state)  # same parameter names: checkpoints stay compatible
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], atol=1e-5, rtol=0)


def test_kernel_names():
    assert kernel_names(True) == KERNELS and kernel_names(False) == ()
    assert kernel_names(["layernorm"]) == ("layernorm",)
    with pytest.raises(ValueError, match="unknown kernel"):
        kernel_names(["flash"])


def _tiny_llama():
    from models import make_model

    torch.manual_seed(0)
    return make_model("hf_llama").model  # the LlamaForCausalLM inside the LightningModule


def test_rotary_patches_a_hf_familys_function_and_trains_alike(monkeypatch):
    """kernels=["rotary"] swaps the modeling module's apply_rotary_pos_emb for the fused kernel (run in the
    Triton interpreter here): the same losses and weights as the family's own, and the kernel really ran."""
    from lightning_tp.kernels import hf_rotary, rotary

    monkeypatch.setattr(_utils, "INTERPRET", True)
    calls = []
    real = rotary.RotaryFunction.apply
    monkeypatch.setattr(rotary.RotaryFunction, "apply", lambda *a: calls.append(1) or real(*a))
    runs = []
    for fused in (False, True):
        model = _tiny_llama()
        module = __import__(type(model.model.layers[0].self_attn).__module__, fromlist=["x"])
        monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)  # undone after the test
        if fused:
            assert apply_kernels(model, ["rotary"]) == [f"{module.__name__}.apply_rotary_pos_emb"]
            assert hasattr(module.apply_rotary_pos_emb, hf_rotary._MARK)
            assert apply_kernels(model, ["rotary"]) == [f"{module.__name__}.apply_rotary_pos_emb"]  # once only
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(2):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        runs.append((losses, model.state_dict()))
    assert calls, "the fused rotary kernel did not run"
    torch.testing.assert_close(torch.tensor(runs[1][0]), torch.tensor(runs[0][0]), atol=1e-5, rtol=0)
    for key, value in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][key], value, atol=1e-5, rtol=0)


def test_rotary_leaves_a_family_with_another_rotation_alone():
    """A family whose rotation pairs neighbouring elements (GPT-J, Cohere style) is not patched."""
    import sys
    import types

    from lightning_tp.kernels.hf_rotary import patch_hf_rotary

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    fake = types.ModuleType("transformers.models.fake_interleaved.modeling")
    fake.apply_rotary_pos_emb = interleaved

    class Attention(torch.nn.Module):
        pass

    Attention.__module__ = fake.__name__
    sys.modules[fake.__name__] = fake
    try:
        assert patch_hf_rotary(Attention()) == [] and fake.apply_rotary_pos_emb is interleaved
    finally:
        del sys.modules[fake.__name__]


def test_rotary_takes_the_fused_path_only_for_the_calls_it_computes_exactly(monkeypatch):
    """4.x's (q, k, cos, sin, position_ids=None, unsqueeze_dim=1) and 5.x's (q, k, cos, sin, unsqueeze_dim=1),
    by position or keyword: fused; position_ids given, another unsqueeze_dim, cos of another dtype: the original."""
    from lightning_tp.kernels import hf_rotary

    def rotate_half(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)

    def v4(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def v5(q, k, cos, sin, unsqueeze_dim=1):
        return v4(q, k, cos, sin, None, unsqueeze_dim)

    fused = []
    real = hf_rotary.fused_rotary
    monkeypatch.setattr(hf_rotary, "fused_rotary", lambda *a: fused.append(1) or real(*a))
    q, k, cos, sin = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    cases = [(v4, (), {}, True), (v4, (None,), {}, True), (v4, (None, 1), {}, True), (v4, (), {"unsqueeze_dim": 1}, True),
             (v4, (torch.arange(5).expand(2, 5),), {}, False), (v5, (), {}, True), (v5, (1,), {}, True),
             (v5, (), {"unsqueeze_dim": 1}, True)]
    for original, args, kwargs, expect_fused in cases:
        before = len(fused)
        got = hf_rotary._fused_twin(original)(q, k, cos, sin, *args, **kwargs)
        assert (len(fused) > before) == expect_fused, (original.__name__, args, kwargs)
        if not args or not torch.is_tensor(args[0]):
            for a, b in zip(got, original(q, k, cos, sin, *args, **kwargs)):
                torch.testing.assert_close(a, b)
    before = len(fused)
    out = hf_rotary._fused_twin(v5)(q.bfloat16(), k.bfloat16(), cos, sin)  # fp32 cos: promoted, as the family does
    assert len(fused) == before and out[0].dtype == torch.float32
