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
