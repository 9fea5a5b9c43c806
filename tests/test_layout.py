"""Every refusal parallelize makes of a bad layout comes from resolve_layout, a step with no collective: each
case below is refused there with torch.distributed never initialized, and parallelize itself raises it with
every collective patched to fail (so none ran before it). The cases are the suite's bad inputs of that kind."""

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import BAD_EXPERTS
from lightning_tp import MegaStrategy
from lightning_tp.layout import resolve_layout
from models import make_model


class Unplanned(nn.Module):  # Linear layers no built-in plan knows
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


class NoBlocks(nn.Module):  # no repeated blocks to cut or recompute
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 16)


class NormedBlocks(nn.Module):  # blocks keeping running statistics (``last``: the last block only)
    def __init__(self, last: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8) if i == 3 or not last
                                                   else nn.Identity()) for i in range(4)])


def _llama_kv1():
    return make_model("hf_llama", kv_heads=1)


def _ce_without_head():
    return make_model("gpt"), {"name": "ce_first", "styles": {"model.loss_fn": "vocab_ce"}}


CASES = {  # name: (module builder, strategy kwargs, world size, words of the refusal)
    "heads": (lambda: make_model("gpt", n_head=3, n_embd=30), dict(tp=2), 2, ["transformer.h.0.attn", "n_head = 3"]),
    "hidden": (lambda: make_model("gpt", n_head=3, n_embd=33), dict(tp=2), 2, ["q_proj", "out_features = 33"]),
    "ffn": (lambda: make_model("encoder", ff=33), dict(tp=2), 2, ["linear1", "out_features = 33"]),
    "no_plan": (Unplanned, dict(tp=2), 2, ["no parallelization plan", "Unplanned", "plan="]),
    "pp_gt_blocks": (lambda: make_model("gpt", n_layer=1), dict(pp=2), 2, ["pp=2", "1 block"]),
    "interleaved_blocks": (lambda: make_model("gpt", n_layer=6), dict(pp=2, virtual_stages=2, microbatches=2,
                           schedule="interleaved_1f1b"), 2, ["6 blocks", "virtual"]),
    "no_blocks_pp": (NoBlocks, dict(pp=2), 2, ["NoBlocks", "block"]),
    "no_blocks_recompute": (NoBlocks, dict(activation_checkpointing=True), 1, ["activation_checkpointing", "blocks"]),
    "running_statistics": (NormedBlocks, dict(activation_checkpointing=True), 1, ["blocks.0.1", "running statistics"]),
    # on the last stage only: refused on the first stage's rank too (every rank checks every stage)
    "running_statistics_on_another_stage": (lambda: NormedBlocks(last=True), dict(
        pp=2, activation_checkpointing=True, pipeline_blocks="blocks"), 2, ["blocks.3.1", "running statistics"]),
    "zero3_kv_heads": (_llama_kv1, dict(tp=2, zero=3), 4, ["k_proj", "key/value heads", "zero=1"]),
    "vocab_ce_without_head": (None, dict(tp=2), 2, ["model.loss_fn", "'vocab_ce' but no 'lm_head'"]),
    "load_full_unmatched": (lambda: make_model("gpt"), dict(tp=2, load_full="OTHER"), 2,
                            ["load_full", "none of the checkpoint's keys"]),
    "load_full_missing": (lambda: make_model("gpt"), dict(tp=2, load_full="PART"), 2,
                          ["load_full=", "no tensor for", "transformer.ln_f.bias"]),
    "cp_eager_attention": (lambda: make_model("hf_llama", config_kw=dict(_attn_implementation="eager")), dict(cp=2), 2,
                           ["attn_implementation='eager'"]),
    "cp_sliding_window": (lambda: make_model("hf_mistral", config_kw=dict(sliding_window=8)), dict(cp=2), 2,
                          ["sliding_window=8"]),
    "p2p_eager_on_nccl": (lambda: make_model("gpt"), dict(pp=2, p2p="eager"), 2, ["p2p='eager'", "NCCL"]),
}
CASES.update({f"experts_{name}": ((lambda kw=model_kw: make_model("gpt", **kw)), strategy_kw, 2, [message])
              for name, (model_kw, strategy_kw, message) in BAD_EXPERTS.items()
              if name not in ("ep_not_dividing_dp", "capacity_out_of_range", "etp_not_tp", "etp_ep_not_dividing_dp",
                            "etp_below_tp_without_ep")})
# (those: refused at construction)


def _case(name, tmp_path):
    build, strategy_kw, world, words = CASES[name]
    kw = dict(strategy_kw)
    if name == "vocab_ce_without_head":
        module, kw["plan"] = _ce_without_head()
    else:
        module = build()
    if kw.get("load_full") == "OTHER":
        torch.save({"state_dict": {"nothing.weight": torch.zeros(1)}}, tmp_path / "other.ckpt")
        kw["load_full"] = str(tmp_path / "other.ckpt")
    if kw.get("load_full") == "PART":  # the module's own checkpoint but one tensor
        state = {k: v for k, v in module.state_dict().items() if not k.endswith("transformer.ln_f.bias")}
        torch.save({"state_dict": state}, tmp_path / "part.ckpt")
        kw["load_full"] = str(tmp_path / "part.ckpt")
    return module, MegaStrategy(**kw).config.with_world(world), words


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_by_the_step_without_collectives(name, tmp_path):
    assert not dist.is_initialized()
    module, config, words = _case(name, tmp_path)
    with pytest.raises(ValueError) as err:
        resolve_layout(config, module, pp_rank=0, nccl=name == "p2p_eager_on_nccl")
    assert all(w in str(err.value) for w in words), (words, str(err.value))


@pytest.mark.parametrize("name", sorted(CASES))
def test_parallelize_refuses_before_any_collective(name, tmp_path, monkeypatch):
    from lightning_tp import parallelize as P

    def collective(*args, **kwargs):
        raise AssertionError("a collective ran before the refusal")

    for op in ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "new_group",
               "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all_single"):
        monkeypatch.setattr(dist, op, collective)
    monkeypatch.setattr(P, "on_nccl", lambda: name == "p2p_eager_on_nccl")
    module, config, words = _case(name, tmp_path)
    mesh = types.SimpleNamespace(pp_rank=0, tp_rank=0, world_size=config.tp * config.pp * config.cp * config.dp)
    with pytest.raises(ValueError) as err:
        P.parallelize(config, mesh, module, torch.device("cpu"))
    assert all(w in str(err.value) for w in words), (words, str(err.value))

