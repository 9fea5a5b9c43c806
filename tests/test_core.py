"""Structure checks in one 2-process launch: shard sizes, Megatron's collective counts, bad input
raised on every rank within seconds, and validate/predict against a single process."""

import warnings

import lightning as L
import pytest
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn

import dist
from examples.gpt.model import GPT, GPTConfig
from helpers import expect_error
from lightning_tp.marks import marks_of
from lightning_tp import MegaStrategy, comm
from lightning_tp.mesh import build_mesh
from lightning_tp.trainer.same_batch import BatchBroadcast
from lightning_tp.plans import checks as plan_checks
from lightning_tp.plans import swap
from models import SEQ, LossRecorder, TokenData, Tokens, make_model, reference_run, trainer_kwargs

B, H = 2, 32


def _parallelize(module, tp, sp, mesh):
    swap.apply(module, plan_checks.resolve(module, tp, sp), mesh.tp_group, tp, mesh.tp_rank, sp)
    return module


def _collectives(n_layer, sp, mesh):
    torch.manual_seed(0)
    model = _parallelize(GPT(GPTConfig(vocab_size=64, block_size=SEQ, n_layer=n_layer, n_embd=H)), 2, sp, mesh)
    x, y = Tokens(B, 64)[0]
    x, y = x.repeat(B, 1), y.repeat(B, 1)
    with comm.count_collectives() as records:
        model(x, y)[1].backward()
    return [(op, numel, group is mesh.tp_group) for op, numel, group in records]


def _per_layer(n_layer_2, n_layer_1):
    """Collectives of one transformer layer: the 2-layer model's multiset minus the 1-layer one's."""
    rest = list(n_layer_2)
    for item in n_layer_1:
        rest.remove(item)
    return sorted(rest)


class Unknown(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def training_step(self, batch, i):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _checks(rank, world):
    torch_dist.init_process_group("gloo")
    mesh = build_mesh(tp=2)
    out = {}

    # 1. shard sizes: every sharded parameter holds 1/tp of the (padded) original
    full = make_model("gpt", vocab_size=63)
    part = _parallelize(make_model("gpt", vocab_size=63), 2, False, mesh)
    ratios = {}
    for name, p in part.named_parameters():
        spec = marks_of(p).tp_spec
        if spec is not None:
            original = full.get_parameter(name)
            padded = list(original.shape)
            padded[spec.dim] = spec.padded or padded[spec.dim]
            ratios[name] = (p.numel(), torch.Size(padded).numel())
    out["ratios"] = ratios

    # 2. Megatron's collective count for one layer, without and with sequence parallelism
    out["layer_tp"] = _per_layer(_collectives(2, False, mesh), _collectives(1, False, mesh))
    out["layer_sp"] = _per_layer(_collectives(2, True, mesh), _collectives(1, True, mesh))

    # 3. bad input: raised on every rank before any collective
    strict = dict(timeout=30)
    out["bad"] = {
        "tp_world": expect_error(world, make_model("gpt"), MegaStrategy(tp=3, **strict)),
        "pp_world": expect_error(world, make_model("gpt"), MegaStrategy(pp=3, **strict)),
        "heads": expect_error(world, make_model("gpt", n_head=3, n_embd=30), MegaStrategy(tp=2, **strict)),
        "hidden": expect_error(world, make_model("gpt", n_head=3, n_embd=33), MegaStrategy(tp=2, **strict)),
        "ffn": expect_error(world, make_model("encoder", ff=33), MegaStrategy(tp=2, **strict)),
        "unknown": expect_error(world, Unknown(), MegaStrategy(tp=2, **strict),
                                 TokenData(8, 64, 2)),
    }

    # 4. sp=True with tp=1: a warning, then a normal run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = MegaStrategy(tp=1, sp=True)
    out["sp_tp1"] = (strategy.sp, [str(w.message) for w in caught])

    # 5. validate and predict after fit (the LM head gathers whole logits outside training)
    model = make_model("gpt")
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(tp=2, sp=True), max_steps=3, **trainer_kwargs())
    data = TokenData(3 * 4, 64, 4)
    trainer.fit(model, data)
    val_loader = torch.utils.data.DataLoader(Tokens(8, 64), batch_size=4)
    out["val"] = trainer.validate(model, val_loader, verbose=False)[0]["val_loss"]
    pred = trainer.predict(model, torch.utils.data.DataLoader([Tokens(2, 64)[i][0] for i in range(2)],
                                                              batch_size=2))
    out["pred_shape"] = tuple(pred[0].shape)
    # a length tp does not divide: without grad it runs without sp (generation token by token), in
    # training it is refused
    model.eval()
    odd = torch.arange(2 * SEQ).view(2, SEQ) % 64
    with torch.no_grad():
        out["odd_logits"] = [model(odd[:, :n]) for n in (SEQ - 1, 1, SEQ)]
    model.train()
    try:
        model.model(odd[:, :-1], odd[:, :-1])
    except ValueError as e:
        out["odd_error"] = str(e)
    # self.all_gather gathers over data-parallel replicas only (here dp = 1), as DDP's would
    out["gathered"] = tuple(model.all_gather(torch.full((3,), float(rank))).shape)  # it passes group=WORLD

    # 6. bf16-mixed: autocast around the user's step, collectives on bf16 activations
    model, rec = make_model("gpt"), LossRecorder()
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(tp=2, sp=True), max_steps=5, precision="bf16-mixed",
                        callbacks=[rec], **trainer_kwargs())
    trainer.fit(model, TokenData(5 * 4, 64, 4))
    out["bf16"] = rec.losses

    # 7. the batch every tp/pp rank of a replica trains on: its first rank's, whatever each loaded
    send = BatchBroadcast(mesh.mp_group, 0, torch.device("cpu"))
    out["batches"] = []
    for step, n in enumerate((4, 4, 6)):  # the third batch changes shape: its layout is sent again
        g = torch.Generator().manual_seed(100 * rank + step)  # every rank loads something else
        batch = {"ids": torch.randint(0, 9, (2, n), generator=g), "text": [f"r{rank}s{step}", "x"],
                 "pair": (torch.rand(n, generator=g) > 0.5, torch.randn(0, 3, generator=g)),
                 "meta": {"step": step + rank, "w": torch.randn(3, generator=g, dtype=torch.float64)}}
        out["batches"].append((batch, send(batch)))
    send.finish()  # the source's last broadcast, before the process exits
    return out


@pytest.fixture(scope="module")
def checks():
    return dist.run(2, _checks)


def test_sharded_parameters_hold_one_tp_th(checks):
    ratios = checks[0]["ratios"]
    assert len(ratios) >= 10
    for name, (local, full) in ratios.items():
        assert local * 2 == full, name


def test_one_layer_issues_megatrons_four_all_reduces(checks):
    bsh = B * SEQ * H
    assert checks[0]["layer_tp"] == [("all_reduce", bsh, True)] * 4


def test_one_layer_with_sp_issues_all_gathers_and_reduce_scatters(checks):
    bsh = B * SEQ * H
    expected = sorted([("all_gather", bsh // 2, True)] * 4 + [("reduce_scatter", bsh, True)] * 4)
    assert checks[0]["layer_sp"] == expected


@pytest.mark.parametrize("case, words", [
    ("tp_world", ["tp=3", "divisible", "2 processes"]),
    ("pp_world", ["pp=3", "divisible"]),
    ("heads", ["transformer.h.0.attn", "n_head = 3", "tp = 2"]),
    ("hidden", ["transformer.h.0.attn.q_proj", "out_features = 33", "tp = 2"]),
    ("ffn", ["linear1", "out_features = 33"]),
    ("unknown", ["no parallelization plan", "Sequential", "plan="]),
])
def test_bad_input_raises_on_every_rank_quickly(checks, case, words):
    for rank_result in checks:
        message, _ = rank_result["bad"][case]
        assert message is not None, f"{case}: no error"
        for w in words:
            assert w in message, f"{case}: {w!r} not in {message!r}"
        # no assertion on its time: a rank that had waited for the 30 s timeout would hold a timeout's words


def test_sp_with_tp1_warns_and_is_ignored(checks):
    sp, messages = checks[0]["sp_tp1"]
    assert sp is False
    assert any("sp=True" in m for m in messages)


def test_validate_and_predict_match_single_process(checks):
    model = make_model("gpt")
    trainer = L.Trainer(devices=1, max_steps=3, use_distributed_sampler=False, **trainer_kwargs())
    trainer.fit(model, TokenData(3 * 4, 64, 4, single=True))
    val_loader = torch.utils.data.DataLoader(Tokens(8, 64), batch_size=4)
    ref = trainer.validate(model, val_loader, verbose=False)[0]["val_loss"]
    assert abs(checks[0]["val"] - ref) < 1e-5
    assert checks[0]["pred_shape"] == (2, SEQ, 64)
    assert [c["gathered"] for c in checks] == [(1, 3)] * 2  # not (2, 3): the tp copies are one replica
    model.eval()
    odd = torch.arange(2 * SEQ).view(2, SEQ) % 64
    with torch.no_grad():
        for n, got in zip((SEQ - 1, 1, SEQ), checks[0]["odd_logits"]):
            torch.testing.assert_close(got, model(odd[:, :n]), atol=1e-5, rtol=0)
    assert "a sequence of 15, which tp=2 does not divide" in checks[1]["odd_error"]


def test_every_rank_of_a_model_copy_gets_its_first_ranks_batch(checks):
    for (sent, _), (loaded, got) in zip(checks[0]["batches"], checks[1]["batches"]):
        assert not torch.equal(loaded["ids"], sent["ids"])  # the ranks did load different batches
        assert got["text"] == sent["text"] and got["meta"]["step"] == sent["meta"]["step"]
        assert isinstance(got["pair"], tuple) and got["pair"][0].dtype == torch.bool
        for a, b in ((got["ids"], sent["ids"]), (got["pair"][0], sent["pair"][0]), (got["pair"][1], sent["pair"][1]),
                     (got["meta"]["w"], sent["meta"]["w"])):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert [got is sent for sent, got in checks[0]["batches"]] == [True] * 3  # the source keeps its own


def test_bf16_mixed_tracks_the_single_process_bf16_run(checks):
    ref, _, _ = reference_run("gpt", {}, 5, 4, precision="bf16-mixed")
    got = checks[0]["bf16"]
    assert len(got) == 5
    assert max(abs(a - b) for a, b in zip(got, ref)) < 2e-2  # bf16 rounding, not a layout error


def test_vocab_parallel_loss_refuses_targets_outside_the_vocabulary_and_keeps_fp64():
    """As torch's cross-entropy: padding marked -1 (ignore_index -100) or a token past the vocabulary is
    an error, raised before any collective (every rank holds the same targets); fp64 logits stay fp64."""
    from lightning_tp.layers import vocab_parallel_cross_entropy

    logits = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    for bad in (-1, 8, 1000):
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
            vocab_parallel_cross_entropy(logits, torch.tensor([0, bad, 2, -100]), 0, 8, None)
    target = torch.tensor([0, 7, 2, -100])
    loss = vocab_parallel_cross_entropy(logits, target, 0, 8, None)
    ref = F.cross_entropy(logits, target, reduction="none")
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, atol=1e-12, rtol=0)


def test_sequence_parallelism_is_decided_per_forward():
    """A length tp does not divide: without grad the forward runs without SP (one process's numbers:
    the parity checks above), with grad it is refused, and under pp (a stage cannot tell the next one)
    always; a divisible length turns SP back on."""
    from lightning_tp.layers.linear import TPContext
    from lightning_tp.plans.hooks import install_sp_boundaries
    from lightning_tp.plans.lookup import Match
    from lightning_tp.plans.base import Plan

    model = nn.Sequential(nn.Identity(), nn.Linear(4, 4))
    ctx = TPContext(group=None, world=2, sp=True)
    install_sp_boundaries(model, Match("", Plan(name="t"), sp_start="0"), ctx)
    odd = torch.randn(2, 3, 4)
    with torch.no_grad():
        model(odd)
        assert ctx.whole and ctx.seq_len == 3 and not ctx.sp_now()
    assert ctx.sp_now()  # a recomputation in a backward (grad on) is the training forward it recomputes
    with pytest.raises(ValueError, match="a sequence of 3, which tp=2 does not divide, and in training"):
        model(odd)
    model(torch.randn(2, 4, 4))
    assert not ctx.whole and ctx.sp_now()
    ctx.sp_fallback = False
    with torch.no_grad(), pytest.raises(ValueError, match="under pp the later stages expect shards"):
        model(odd)
