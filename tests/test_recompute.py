"""Activation checkpointing (lightning_tp.recompute) in one process: the same numbers as keeping the
activations (dropout on), less saved for backward, which blocks it picks, and its bad input. The
distributed layouts (pp schedules, tp+sp, the encoder-decoder) are in the parity launches."""

import copy

import pytest
import torch
from torch import nn

from lightning_tp import MegaStrategy
from lightning_tp.recompute import full as recompute
from lightning_tp.pipeline.cut.split import plan_stages
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
    gpt8 = make_model("gpt", n_layer=8)
    interleaved = plan_stages(gpt8, 2, 2, "model.transformer.h", interleaved=True)
    assert recompute.targets(gpt8, 1, interleaved, pp_rank=0) == [("model.transformer.h", 0), ("model.transformer.h", 4)]
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
    nested.frozen = nn.ModuleList(nn.Linear(2, 2).requires_grad_(False) for _ in range(2))
    nested.metrics = nn.ModuleList(nn.Identity() for _ in range(2))
    assert recompute.block_lists(nested) == ["blocks"]  # nothing to recompute for in those
    assert recompute.block_lists(nested, "blocks.0.experts") == ["blocks.0.experts"]
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    loose = nn.Module()  # no ModuleList of blocks: a Sequential or ModuleDict of them is recomputed
    loose.stem = nn.Sequential(Pair(), Pair())
    loose.layers = nn.ModuleDict({"a": Pair(), "b": Pair()})
    loose.heads = nn.ModuleDict({"x": nn.Linear(2, 2), "y": nn.Linear(2, 2)})  # layers, not blocks
    loose.stacks = nn.ModuleDict({"x": nn.ModuleList([Pair()]), "y": nn.ModuleList([Pair()])})  # lists, not blocks
    assert recompute.block_lists(loose) == ["stem", "layers"]
    recompute.apply(loose, recompute.targets(loose, True))
    assert loose.layers["b"]._lightning_tp_recompute and loose.stem[1]._lightning_tp_recompute


@pytest.mark.parametrize("value", [-1, 1.5, "yes"])
def test_bad_option_values_are_refused_at_construction(value):
    with pytest.raises(ValueError, match="activation_checkpointing="):
        MegaStrategy(activation_checkpointing=value)
    MegaStrategy(activation_checkpointing=0)  # 0 is off, as False


def test_what_a_recomputed_forward_would_change_twice_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="quantizers' activation ranges"):
        MegaStrategy(activation_checkpointing=True, quant="int8")
    MegaStrategy(activation_checkpointing=False, quant="int8")  # off: fine
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)) for _ in range(2))
    with pytest.raises(ValueError, match=r"blocks.0.1 keeps running statistics"):
        recompute.targets(model, True)
    # ZB-H1's weight half needs one recomputation shared among its backward calls (torch >= 2.10)
    monkeypatch.delattr(torch.utils.checkpoint, "GraphExecGroup", raising=False)
    with pytest.raises(ValueError, match="torch >= 2.10.*zb_keep_recomputed=True"):
        MegaStrategy(pp=2, schedule="zb_h1", activation_checkpointing=True)
    MegaStrategy(pp=2, schedule="zb_h1", activation_checkpointing=True, zb_keep_recomputed=True)  # its own: fine
    with pytest.raises(ValueError, match="torch >= 2.10.*zb_keep_recomputed=True"):  # the same split backward
        MegaStrategy(pp=2, split_backward=True, activation_checkpointing=True)
    MegaStrategy(pp=2, split_backward=True, activation_checkpointing=True, zb_keep_recomputed=True)
    for kw in (dict(pp=2, activation_checkpointing=True), dict(pp=2, schedule="zb_h1"), dict(pp=2, split_backward=True),
               dict(activation_checkpointing=True, split_backward=True)):  # the last: no pipeline, no split
        with pytest.raises(ValueError, match="zb_keep_recomputed=True. applies to a split backward .schedule='zb_h1', "
                                             "or split_backward=True or 'drain'; the default 'auto' splits none where "
                                             "blocks are recomputed. with activation"):
            MegaStrategy(zb_keep_recomputed=True, **kw)
    for kw in (dict(pp=2), dict()):
        with pytest.raises(ValueError, match="split_backward"):
            MegaStrategy(split_backward="yes", **kw)


class KwargsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, *, x, scale=1.0):
        return self.drop(self.lin(x)) * scale


def test_keyword_only_blocks_and_deep_copies():
    """Keywords reach torch's checkpoint as positional arguments (it reads devices off those), and a
    deep copy (an EMA callback's) runs its own weights, not the original's."""
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(KwargsOnly() for _ in range(2))
    x = torch.randn(4, 8)

    def loss_and_grads(m):
        torch.manual_seed(1)
        y = x
        for b in m.blocks:
            y = b(x=y, scale=2.0)
        y.sum().backward()
        out = y.sum().item(), [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        return out

    ref = loss_and_grads(model)
    recompute.apply(model, recompute.targets(model, True))
    got = loss_and_grads(model)
    assert got[0] == ref[0] and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert loss_and_grads(twin)[0] == 0.0 and loss_and_grads(model)[0] == ref[0]


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # GPT-2's blocks take their cache positionally
def test_a_hugging_face_key_value_cache_is_left_out_of_recomputed_blocks(family):
    """Llama and GPT-2 with use_cache=True (their configs' default) while training: a cache updated again
    in the recompute would double the key/value length; the recomputed blocks run without it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=True) \
        if family == "llama" else transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                          use_cache=True)

    def run(checkpointed):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        if checkpointed:
            recompute.apply(model, recompute.targets(model, True))
        x = _batch(2)[0]
        model(input_ids=x, labels=x).loss.backward()
        return [p.grad for p in model.parameters()]

    ref = run(False)
    for a, b in zip(run(True), ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)

    if family == "gpt2":
        return
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match="model.layers.0 .and 1 more. already recompute"):
        recompute.targets(model, True)


def test_blocks_called_piece_by_piece_have_each_piece_recomputed():
    """``for mix, mlp in self.blocks``: a block that is an nn.ModuleList is never called itself, so
    its pieces are checkpointed (a wrapper on the list would recompute, and save, nothing)."""
    def run(n):
        torch.manual_seed(0)
        model = make_model("loop", container="pieces")
        if n:
            recompute.apply(model, recompute.targets(model, n))
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x).square().mean()
        loss.backward()
        return loss.item(), {k: p.grad for k, p in model.named_parameters()}, saved[0], model

    loss, grads, kept, _ = run(False)
    got_loss, got_grads, recomputed, model = run(True)
    assert got_loss == loss and all(torch.equal(got_grads[k], g) for k, g in grads.items())
    assert recomputed < kept / 2
    assert all(piece._lightning_tp_recompute for block in model.blocks for piece in block)
