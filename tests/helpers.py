"""What several test files share (this is not a test module: test modules import from here, never from
each other): the parity harness that trains a dict of layouts in one launch and checks each against
the single-process ground truth, the launch a file's world2/world4 fixtures make of its own configs,
fitting a bad configuration on every rank, the expert layouts fit and explain refuse, and a small
pipeline model (Net) with its data."""

from __future__ import annotations

import contextlib
import os
import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dist
from lightning_tp import MegaStrategy, consolidate
from lightning_tp.kernels import torch_path
from lightning_tp.marks import marks_of
from models import LossRecorder, TokenData, make_model, reference_run, trainer_kwargs, vocab_of

STEPS, BATCH, TOL = int(os.environ.get("LTP_TEST_STEPS", 10)), 4, 1e-5
QAT_LOSS_TOL, QAT_WEIGHT_TOL = 5e-4, 5e-3
FP16_TOL = 5e-3  # fp16 autocast: the same ops, but CPU fp16 matmuls may block a microbatch differently
FP16 = dict(fp16=True, max_steps=10)
BF16_TRUE_LOSS_TOL = 2 ** -4  # bf16-true: the loss is itself a bf16 number, one step 2**-4 wide in [4, 8)
BF16_TOL = 2e-2  # bf16 autocast: 8 bits of mantissa, rounding differs with the microbatch shapes
# steps that must agree within TOL: int8 held all 10 on earlier CPUs; on a Xeon with AVX-512 (2026-12-01)
# its first flip (below) moves step 9 by 2.8e-5, the delayed range's step 6 by 2.6e-5; w4a8's coarser grid
# meets one after 5 on this data. The later steps agree within a few flips (QAT_LOSS_TOL). Files with QAT
# configs of their own add theirs (tests/pipeline/test_pipeline.py).
QAT_EXACT_STEPS = {"tp2_sp_int8_qat": 8, "tp2_w4a8_qat": 5, "tp2_sp_int8_qat_delayed": 5}

# A config: name -> (model kind, model kwargs, strategy kwargs, trainer kwargs); see make_model and steps_of.


def train_all(rank, world, configs, ckdir):
    """On each rank: fit every config in turn, save and consolidate its checkpoint; what check reads."""
    out = {}
    for name, (kind, model_kw, strategy_kw, trainer_kw) in configs.items():
        model = make_model(kind, **model_kw)
        dp = world // (strategy_kw.get("tp", 1) * strategy_kw.get("pp", 1) * strategy_kw.get("cp", 1))
        rec = LossRecorder()
        batch, samples = trainer_kw.get("batch", BATCH), trainer_kw.get("samples")
        steps, trainer_kw = steps_of(trainer_kw)
        trainer = L.Trainer(devices=world, strategy=MegaStrategy(**strategy_kw, timeout=120), max_steps=steps,
                            callbacks=[rec], **trainer_kwargs(**trainer_kw))
        n = samples or steps * batch * dp * trainer_kw.get("accumulate_grad_batches", 1)
        with torch_path() if strategy_kw.get("kernels") else contextlib.nullcontext():
            trainer.fit(model, TokenData(n, vocab_of(model), batch, crops=configs[name][3].get("crops", False)))
        kernels = strategy_kw.get("kernels")
        if kernels:  # every kernel asked for took its place (True: the example GPT's norms and GeLU)
            fused = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Fused")]
            names = {"layernorm": "FusedLayerNorm", "rmsnorm": "FusedRMSNorm", "gelu": "FusedBiasGeLU"}
            want = {"FusedLayerNorm", "FusedBiasGeLU"} if kernels is True else {names[k] for k in kernels if k in names}
            assert want <= set(fused), fused
            if kernels is not True and "rotary" in kernels:
                import sys

                patched = {type(m).__module__ for m in model.modules()}
                assert any(hasattr(getattr(sys.modules[n], "apply_rotary_pos_emb", None), "_lightning_tp_fused")
                           for n in patched), patched
        path = f"{ckdir}/{name}.ckpt"
        trainer.save_checkpoint(path)
        replicated = {n: whole(p).detach().clone() for n, p in model.named_parameters() if marks_of(p).tp_spec is None}
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        overlap = trainer.strategy._grads.overlap
        out[name] = dict(losses=rec.losses, dp_overlap=overlap is not None, weights=consolidate(path) if rank == 0 else None,
                         launched_early=getattr(overlap, "launched_early", None),
                         buckets=None if overlap is None else overlap.early_buckets,
                         scaler_agrees=getattr(scaler, "_lightning_tp_agrees", False),
                         replicated=replicated, metrics={k: float(v) for k, v in trainer.callback_metrics.items()})
    return out


def whole(p):
    """A parameter's (tp-local) tensor; zero=3's DTensor gathered over dp (collective: every rank calls it)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def train_launch(world, configs, tmp_path_factory, tag):
    """One launch of ``world`` local processes training every config (train_all); a file's module-scoped
    world2/world4 fixture returns this for its own configs."""
    return dist.run(world, train_all, configs, str(tmp_path_factory.mktemp(tag)))


def steps_of(trainer_kw):
    """A config may ask for other steps (``max_steps`` in its trainer kwargs; STEPS by default), another
    per-replica batch size (``batch``; BATCH by default) and a dataset size (``samples``, dp = 1 only:
    e.g. one that leaves each epoch a smaller last batch): all are taken out of the kwargs."""
    rest = {k: v for k, v in trainer_kw.items() if k not in ("max_steps", "batch", "samples", "crops")}
    return trainer_kw.get("max_steps", STEPS), rest


def check(results, name, configs, world):
    """Config ``name`` of a train_launch against the single-process run: per-step losses, consolidated
    weights, replicated parameters alike on every rank."""
    kind, model_kw, strategy_kw, trainer_kw = configs[name]
    dp = world // (strategy_kw.get("tp", 1) * strategy_kw.get("pp", 1) * strategy_kw.get("cp", 1))
    replicas = dp * strategy_kw.get("cp", 1)  # ranks averaging gradients (dp x cp)
    batch, samples = trainer_kw.get("batch", BATCH), trainer_kw.get("samples")
    steps, trainer_kw = steps_of(trainer_kw)
    ref_losses, ref_weights, ref_metrics = reference_run(kind, model_kw, steps, batch * dp, samples=samples,
                                                         crops=configs[name][3].get("crops", False), **trainer_kw)
    got = results[0][name]
    tol, weight_tol = TOL, TOL
    if "quant" in strategy_kw:
        # The QAT forward is exact under tp (integer-code matmuls), but gradients are float sums in
        # another order: weights differ by ~1e-7 after a step, and now and then that moves a value
        # across a rounding boundary of a quantizer (one code flip moves the loss by ~1e-5..1e-4).
        # The first steps must agree tightly; later ones within a few flips.
        exact = QAT_EXACT_STEPS[name]
        early = torch.tensor(got["losses"][:exact]) - torch.tensor(ref_losses[:exact])
        assert early.abs().max() < TOL, early
        tol, weight_tol = (TOL, TOL) if exact == steps else (QAT_LOSS_TOL, QAT_WEIGHT_TOL)
    if trainer_kw.get("fp16"):  # and the ranks' GradScalers skip or step together (grads.agree_on_overflow)
        tol = weight_tol = FP16_TOL
        assert got["scaler_agrees"]
    if trainer_kw.get("precision") == "bf16-mixed":
        tol = weight_tol = BF16_TOL
    if trainer_kw.get("precision") == "bf16-true":
        tol, weight_tol = BF16_TRUE_LOSS_TOL, BF16_TOL
    # dp replicas average their gradients while backward runs (dp/overlap.py); under a pipeline, each
    # chunk's final weight-gradient pass of the step (B, ZB-H1's W) starts the sync of the gradients it
    # finalizes: all of them (but an encoder-decoder's embedding copies, synced after), none while
    # Lightning accumulates over batches
    pipelined = strategy_kw.get("pp", 1) > 1 or strategy_kw.get("microbatches", 1) > 1
    zero = strategy_kw.get("zero", 0)
    # zero=3: FSDP2 reduce-scatters in the backward, no DPOverlap (zero=1: a ZeroOverlap)
    assert got["dp_overlap"] == (replicas > 1 and zero != 3)
    if replicas > 1 and zero != 3 and pipelined:
        if trainer_kw.get("accumulate_grad_batches", 1) > 1:
            assert got["launched_early"] == 0
        else:
            assert got["launched_early"] == got["buckets"] > 0
    per_step = trainer_kw.get("accumulate_grad_batches", 1) * model_kw.get("manual_accumulate", 1)
    assert len(got["losses"]) == len(ref_losses) == steps * per_step
    if "tokens" in ref_metrics:  # a torchmetrics SumMetric: synced over dp only, not tp replicas
        assert got["metrics"]["tokens"] == ref_metrics["tokens"]
    if "acc" in ref_metrics:  # read off whole logits
        assert got["metrics"]["acc"] == pytest.approx(ref_metrics["acc"], abs=1e-6)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), atol=tol, rtol=0)
    assert ref_losses[-1] < ref_losses[0] - 0.05, "the reference did not learn: the comparison would be vacuous"
    assert set(got["weights"]) == set(ref_weights)
    for key, ref in ref_weights.items():
        torch.testing.assert_close(got["weights"][key], ref, atol=weight_tol, rtol=0, msg=lambda m: f"{key}: {m}")
    # replicated parameters stay bit-identical on every rank that holds them (tp and dp replicas,
    # and a tied embedding on the first and last pipeline stage)
    for other in results[1:]:
        for key, value in got["replicated"].items():
            if key in other[name]["replicated"]:
                assert torch.equal(value, other[name]["replicated"][key]), key


def expect_error(world, model, strategy, data=None):
    """Fit a bad configuration; return (message, seconds). Every rank must raise, none may hang."""
    start = time.monotonic()
    try:
        trainer = L.Trainer(devices=world, strategy=strategy, max_steps=1, **trainer_kwargs())
        trainer.fit(model, data or TokenData(8, 64, 2))
    except Exception as e:  # noqa: BLE001 - we return it to the test
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return None, time.monotonic() - start


# ------------------------------------------------------------------ expert layouts MegaStrategy refuses

GPT_MOE = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
BAD_EXPERTS = {  # name: (model kwargs, strategy kwargs, expected message): refused by fit and explain alike
    "ep_not_dividing_dp": (dict(GPT_MOE, n_expert=4), dict(ep=4), "ep must divide 2"),
    "ep_not_dividing_experts": (dict(GPT_MOE, n_expert=3), dict(ep=2), "has 3 experts, which ep=2 does not divide"),
    "no_moe_layer": (dict(GPT_MOE), dict(ep=2), "has none this project knows"),
    "top_k_above_experts": (dict(GPT_MOE, n_expert=2, n_expert_per_token=4), dict(ep=2),
                            "top_k=4 of 2 experts"),
    "capacity_out_of_range": (dict(GPT_MOE, n_expert=4), dict(moe_capacity=0), "a capacity factor is a number in"),
    "etp_not_tp": (dict(GPT_MOE, n_expert=4), dict(tp=2, etp=4), "etp=tp=2 or another divisor of tp"),
    "etp_below_tp_without_ep": (dict(GPT_MOE, n_expert=4), dict(tp=4, etp=2), "set ep > 1 (ep x etp ranks"),
    "etp_ep_not_dividing_dp": (dict(GPT_MOE, n_expert=4), dict(tp=2, ep=2, etp=2), "ep must divide 1"),
    "etp_without_moe": (dict(GPT_MOE), dict(tp=2, etp=2), "etp=2) applies to mixture-of-experts"),
    "capacity_without_moe": (dict(GPT_MOE), dict(moe_capacity=1.0), "moe_capacity=1.0) applies to mixture-of-experts"),
}


# ------------------------------------------------------------------ a small model pipeline tests subclass

NET_VOCAB, NET_HIDDEN, NET_SEQ = 16, 8, 4  # Net's vocabulary, width, sequence length


class NetBlock(nn.Module):
    """Net's block: a pre-norm residual Linear, with the keyword inputs pipeline tests call it by."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(NET_HIDDEN), nn.Linear(NET_HIDDEN, NET_HIDDEN)

    def forward(self, x, mask=None, x0=None, aux=False):
        y = x + self.fc(self.norm(x)) * (1 if mask is None else mask)
        y = y if x0 is None else y + 0.5 * x0
        return (y, y.pow(2).mean()) if aux else y


class Net(L.LightningModule):
    """A small pipeline model: embedding, 4 blocks, final norm, head. ``style``: how the blocks are
    called; ``layout``: how the modules outside them are registered and called."""

    def __init__(self, style="plain", layout="plain"):
        super().__init__()
        self.style, self.layout = style, layout
        torch.manual_seed(0)
        self.emb = nn.Embedding(NET_VOCAB, NET_HIDDEN if layout != "in_proj" else 4)
        if layout == "in_proj":  # OPT's project_in: a Linear before the blocks, registered before them
            self.project_in = nn.Linear(4, NET_HIDDEN)
        if layout in ("norm_first", "norm_elsewhere"):  # OPT's final norm, registered before the blocks
            self.norm = nn.LayerNorm(NET_HIDDEN)
        self.blocks = nn.ModuleList(NetBlock() for _ in range(4))
        if layout not in ("norm_first", "norm_elsewhere"):
            self.norm = nn.LayerNorm(NET_HIDDEN)
        self.head = nn.Linear(NET_HIDDEN, NET_VOCAB)

    def forward(self, x):
        h = self.emb(x)
        if self.layout == "in_proj":
            h = self.project_in(h)
        x0, aux = h, 0.0
        for block in self.blocks:
            if self.style == "keywords":  # the hidden states not the first keyword
                h = block(mask=torch.ones(()), x=h)
            elif self.style == "x0":  # a value residual: the embedding's output given to every block
                h = block(h, x0=x0)
            elif self.style == "aux":  # an MoE-like auxiliary loss per block, added to the loss
                h, a = block(h, aux=True)
                aux = aux + a
            else:
                h = block(h)
        if self.layout == "norm_elsewhere":
            return self.finish(h) + 0 * aux
        if self.layout == "tied_functional":  # a head computed with the embedding's weight
            return F.linear(self.norm(h), self.emb.weight)
        return self.head(self.norm(h)) + 0 * aux

    def finish(self, h):
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def net_data(n=16, seed=0):
    """n random token rows for Net, each with its next-token targets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, NET_VOCAB, (n, NET_SEQ), generator=g)
    return torch.utils.data.TensorDataset(x, torch.roll(x, -1, 1))


def net_loader(n=16, seed=0):
    """net_data in batches of 4."""
    return torch.utils.data.DataLoader(net_data(n, seed), batch_size=4)
