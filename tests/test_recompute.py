"""Activation checkpointing (lightning_tp.recompute) in one process: the same numbers as keeping the
activations (dropout on), less saved for backward, which blocks it picks, and its bad input. The
distributed layouts (pp schedules, tp+sp, the encoder-decoder) are in the parity launches."""

import pytest
import torch
from torch import nn

from lightning_tp import MegaStrategy, recompute
from lightning_tp.pipeline.split import plan_stages
from models import Tokens, make_model


def _batch(n=8, vocab=64):
    data = Tokens(n, vocab)
    return torch.stack([data[i][0] for i in range(n)]), torch.stack([data[i][1] for i in range(n)])


def _step(n, dropout=0.1):
    """(loss, grads, bytes saved for backward, the next random number) of one training step of a
    3-block GPT with ``activation_checkpointing=n`` (False: none)."""
    model = make_model("gpt", n_layer=3, dropout=dropout)
    if n:
        recompute.apply(model, recompute.targets(model, n))
    batch = _batch()
    torch.manual_seed(5)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model.model(*batch)
    loss.backward()
    return loss.item(), {k: p.grad for k, p in model.named_parameters()}, saved[0], torch.rand(1).item()


def test_recomputed_blocks_give_the_same_loss_gradients_and_random_stream_with_dropout():
    base = _step(False)
    for n in (True, 1):
        got = _step(n)
        assert got[0] == base[0] and got[3] == base[3], n  # the dropout masks were replayed, not redrawn
        for k, g in base[1].items():
            assert torch.equal(got[1][k], g), (n, k)


def test_recomputed_blocks_save_only_their_inputs():
    _, _, kept, _ = _step(False, dropout=0.0)
    _, _, all_blocks, _ = _step(True, dropout=0.0)
    _, _, first_block, _ = _step(1, dropout=0.0)
    assert all_blocks < kept / 4  # each block keeps its input (and the embedding and head theirs)
    assert all_blocks < first_block < kept  # one of the three blocks recomputed: about a third less
    assert abs((kept - first_block) - (kept - all_blocks) / 3) < 0.05 * kept


def test_no_grad_runs_the_plain_forward_and_state_dict_keys_stay():
    model = make_model("gpt", n_layer=3)
    keys = list(model.state_dict())
    ref = model.model(_batch()[0])
    recompute.apply(model, recompute.targets(model, True))
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model.model(_batch()[0]), ref, atol=0, rtol=0)


def test_which_blocks():
    gpt = make_model("gpt", n_layer=4)
    assert recompute.targets(gpt, True) == [("model.transformer.h", i) for i in range(4)]
    assert recompute.targets(gpt, 2) == [("model.transformer.h", 0), ("model.transformer.h", 1)]
    layout = plan_stages(gpt, 2, 1, "model.transformer.h")  # blocks 0-1 on rank 0, 2-3 on rank 1
    assert recompute.targets(gpt, 1, layout, pp_rank=1) == [("model.transformer.h", 2)]
    assert recompute.targets(gpt, True, layout, pp_rank=0) == [("model.transformer.h", 0), ("model.transformer.h", 1)]
    interleaved = plan_stages(make_model("gpt", n_layer=8), 2, 2, "model.transformer.h", interleaved=True)
    assert recompute.targets(gpt, 1, interleaved, pp_rank=0) == [("model.transformer.h", 0), ("model.transformer.h", 4)]
    # an encoder-decoder without a pipeline: both lists; a list inside a block is left to its block
    demo = make_model("demo_transformer")
    assert [p for p, _ in recompute.targets(demo, 1)] == ["model.transformer.encoder.layers",
                                                          "model.transformer.decoder.layers"]

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    nested = nn.Module()
    nested.blocks = nn.ModuleList(Experts() for _ in range(2))
    assert recompute.block_lists(nested) == ["blocks"]
    assert recompute.block_lists(nested, "blocks.0.experts") == ["blocks.0.experts"]


@pytest.mark.parametrize("value", [0, -1, 1.5, "yes"])
def test_bad_option_values_are_refused_at_construction(value):
    with pytest.raises(ValueError, match="activation_checkpointing="):
        MegaStrategy(activation_checkpointing=value)


def test_quantization_aware_layers_are_refused_with_it():
    with pytest.raises(ValueError, match="quantizers' activation ranges"):
        MegaStrategy(activation_checkpointing=True, quant="int8")
    MegaStrategy(activation_checkpointing=False, quant="int8")  # off: fine
