"""The grouped GEMM of a rank's ModuleList experts: the same outputs and gradients as calling each expert on
its rows, for every expert class it knows; the loop (None) wherever grouping would change what runs."""

import copy

import pytest
import torch
from torch import nn

from examples.gpt.model import MLP, GPTConfig
from lightning_tp.experts.blocks.grouped import grouped_forward

COUNTS = [5, 0, 3, 8]  # an expert without rows among them


def _experts_of_installed_families():
    """(name, four experts) for the example GPT and each 4.x Hugging Face / litgpt expert class installed."""
    found = [("example_gpt_bias", [MLP(GPTConfig(n_embd=16, bias=True, dropout=0.0)) for _ in COUNTS]),
             ("example_gpt", [MLP(GPTConfig(n_embd=16, bias=False, dropout=0.0)) for _ in COUNTS])]
    try:
        import transformers as T
        from transformers.models.mixtral import modeling_mixtral as mixtral
    except ImportError:
        return found
    common = dict(hidden_size=16, intermediate_size=32, hidden_act="silu")
    if hasattr(mixtral, "MixtralBlockSparseTop2MLP"):  # transformers 4.x: experts in a ModuleList
        from transformers.models.olmoe.modeling_olmoe import OlmoeMLP
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP
        found += [("hf_mixtral", [mixtral.MixtralBlockSparseTop2MLP(T.MixtralConfig(**common)) for _ in COUNTS]),
                  ("hf_qwen2_moe", [Qwen2MoeMLP(T.Qwen2MoeConfig(**common), 32) for _ in COUNTS]),
                  ("hf_qwen3_moe", [Qwen3MoeMLP(T.Qwen3MoeConfig(**common), 32) for _ in COUNTS]),
                  ("hf_olmoe", [OlmoeMLP(T.OlmoeConfig(**common)) for _ in COUNTS])]
    try:
        from litgpt.config import Config
        from litgpt.model import LLaMAMLP
    except ImportError:
        return found
    for bias in (False, True):
        config = Config(n_embd=16, n_head=4, intermediate_size=32, bias=bias)
        found.append((f"litgpt{'_bias' if bias else ''}", [LLaMAMLP(config) for _ in COUNTS]))
    return found


def _looped(experts, rows, counts):
    return torch.cat([e(c) for e, c in zip(experts, rows.split(counts))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_the_loop_in_outputs_and_gradients(dtype):
    torch.manual_seed(0)
    families = _experts_of_installed_families()
    for name, experts in families:
        experts = [e.to(dtype) for e in experts]
        twins = copy.deepcopy(experts)
        rows = torch.randn(sum(COUNTS), 16, dtype=dtype, requires_grad=True)
        rows2 = rows.detach().clone().requires_grad_()
        y, y2 = grouped_forward(experts, rows, COUNTS), _looped(twins, rows2, COUNTS)
        assert y is not None, name
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y, y2, atol=tol, rtol=tol, msg=name)
        g = torch.randn_like(y)
        (y * g).sum().backward()
        (y2 * g).sum().backward()
        torch.testing.assert_close(rows.grad, rows2.grad, atol=tol, rtol=tol, msg=name)
        for (pname, p), p2 in zip([(n, p) for e in experts for n, p in e.named_parameters()],
                                  [p for e in twins for p in e.parameters()]):
            torch.testing.assert_close(p.grad, p2.grad, atol=tol * 4, rtol=tol, msg=f"{name}.{pname}")
    assert len(families) >= 2


def test_grouped_experts_under_autocast_compute_in_its_dtype_as_linear_does():
    torch.manual_seed(0)
    experts = [MLP(GPTConfig(n_embd=16, bias=True, dropout=0.0)) for _ in COUNTS]
    rows = torch.randn(sum(COUNTS), 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y2 = grouped_forward(experts, rows, COUNTS), _looped(experts, rows, COUNTS)
    assert y.dtype == y2.dtype == torch.bfloat16
    torch.testing.assert_close(y, y2, atol=2e-2, rtol=2e-2)


class _Swapped(nn.Linear):
    """A layer put in place of a Linear (as QAT does): its own forward must run."""


def test_the_loop_runs_wherever_grouping_would_change_what_runs():
    def experts(**kw):
        return [MLP(GPTConfig(**dict(dict(n_embd=16, bias=False, dropout=0.0), **kw))) for _ in COUNTS]

    rows = torch.randn(sum(COUNTS), 16)
    assert grouped_forward(experts(), rows, COUNTS) is not None
    odd = experts(n_embd=6)  # 24-byte rows: _grouped_mm wants 16-byte strides
    assert grouped_forward(odd, torch.randn(sum(COUNTS), 6), COUNTS) is None
    assert grouped_forward(experts(dropout=0.1), rows, COUNTS) is None  # dropout in training
    assert grouped_forward([e.eval() for e in experts(dropout=0.1)], rows, COUNTS) is not None
    hooked = experts()
    hooked[2].c_fc.register_forward_hook(lambda m, a, o: o * 2)
    assert grouped_forward(hooked, rows, COUNTS) is None
    swapped = experts()
    swapped[1].c_proj = _Swapped(64, 16, bias=False)
    assert grouped_forward(swapped, rows, COUNTS) is None
    mixed = experts()[:3] + [nn.Sequential(nn.Linear(16, 16))]
    assert grouped_forward(mixed, rows, COUNTS) is None


def test_the_expert_parallel_layer_gives_the_same_numbers_grouped_and_looped(monkeypatch):
    """The layer's choice (grouped on CUDA, the loop on CPU) changes no number: the example GPT's MoE block
    behind the dispatch (one process), grouped forced on against the loop."""
    from examples.gpt.model import MoE
    from lightning_tp.experts.blocks import layer as ep_layer
    from lightning_tp.experts.families import family_of

    torch.manual_seed(0)
    block = MoE(GPTConfig(n_embd=16, n_expert=4, n_expert_per_token=2, bias=True, dropout=0.0))
    runs, real = {}, ep_layer.grouped_forward
    for grouped in (False, True):
        layer = ep_layer.expert_parallel(copy.deepcopy(block), family_of(block), None, 1, 0)
        monkeypatch.setattr(ep_layer, "runs_grouped", lambda rows, grouped=grouped: grouped)
        called = []
        monkeypatch.setattr(ep_layer, "grouped_forward", lambda *a: called.append(1) or real(*a))
        x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = layer(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        runs[grouped] = (y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}, bool(called))
    assert runs[True][3] and not runs[False][3]
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(runs[True][1], runs[False][1], atol=1e-6, rtol=1e-6)
    for name, grad in runs[False][2].items():
        torch.testing.assert_close(runs[True][2][name], grad, atol=1e-6, rtol=1e-6, msg=name)
