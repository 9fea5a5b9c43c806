"""Dropout under tp/pp (one 2-process launch): split activations draw independent masks, replicated
ones the same, pipeline stages their own, your code's default generator stays alike on every stage,
and recomputation (ours, Hugging Face's) draws the forward's masks again."""

import functools

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dist
from lightning_tp import MegaStrategy
from models import SEQ, TokenData, trainer_kwargs

P = 0.5
PLAN = {"name": "drop_lm", "styles": {"emb": "vocab", "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
                                      "blocks.*.norm": "sp_norm", "out": "lm_head"},
        "sp_start": "blocks.*", "blocks": "blocks"}


class DropBlock(nn.Module):
    def __init__(self, d: int, p: float):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop_in, self.drop_out = nn.Dropout(p), nn.Dropout(p)  # split over tp / replicated (without sp)

    def forward(self, x):
        return x + self.drop_out(self.down(self.drop_in(F.gelu(self.up(self.norm(x))))))


class DropLM(L.LightningModule):
    def __init__(self, p: float = P, layers: int = 2, d: int = 16, vocab: int = 64, own_checkpoint: bool = False,
                 pieces: bool = False):
        super().__init__()
        L.seed_everything(0, verbose=False)
        self.emb, self.out = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList([DropBlock(d, p) for _ in range(layers)])
        if pieces:  # each block a ModuleList of two, called one by one (see pipeline.block_lists)
            self.blocks = nn.ModuleList([nn.ModuleList([DropBlock(d, p), DropBlock(d, p)]) for _ in range(layers)])
        self.own_checkpoint = own_checkpoint

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.emb(x)
        if isinstance(self.blocks[0], nn.ModuleList):
            for first, second in self.blocks:
                h = second(first(h))
        else:
            for block in self.blocks:
                h = checkpoint(block, h, use_reentrant=False) if self.own_checkpoint else block(h)
        loss = F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Record(L.Callback):
    """The first step's dropout masks by module name, and the default generator after every step."""

    def __init__(self):
        self.masks, self.default_rng = {}, []

    def on_fit_start(self, trainer, pl_module):
        for name, m in pl_module.named_modules():
            if isinstance(m, nn.Dropout):
                m.register_forward_hook(functools.partial(self._keep, name))

    def _keep(self, name, module, args, out):
        self.masks.setdefault(name, (out == 0) & (args[0] != 0))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.default_rng.append(torch.get_rng_state())


def _fit(world, model, steps=3, **strategy):
    rec = Record()
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(plan=PLAN, timeout=60, **strategy), max_steps=steps,
                        callbacks=[rec], **trainer_kwargs())
    trainer.fit(model, TokenData(steps * 4, 64, 4))
    return rec, {n: p.detach().clone() for n, p in model.named_parameters()}


def _hf_gpt2(grad_ckpt: bool):
    import transformers as T

    class HFGPT2(L.LightningModule):
        def __init__(self):
            super().__init__()
            L.seed_everything(0, verbose=False)
            config = T.GPT2Config(vocab_size=64, n_positions=SEQ * 2, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)
            config._attn_implementation = "eager"  # attention dropout drawn by torch ops
            self.model = T.GPT2LMHeadModel(config)
            if grad_ckpt:
                self.model.gradient_checkpointing_enable()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.model(input_ids=x, labels=y).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return HFGPT2()


def _checks(rank, world):
    out = {}
    out["tp"] = _fit(world, DropLM(), tp=2)[0].masks
    out["sp"] = _fit(world, DropLM(), tp=2, sp=True)[0].masks
    rec, _ = _fit(world, DropLM(layers=3), pp=2, microbatches=2, stage_layers=[1, 2])
    out["pp"] = (rec.masks, rec.default_rng)
    rec, _ = _fit(world, DropLM(layers=3, pieces=True), pp=2, microbatches=2, stage_layers=[1, 2])
    out["pp_pieces"] = (rec.masks, rec.default_rng)
    out["recompute_pp_pieces"] = [_fit(world, DropLM(pieces=True), activation_checkpointing=ac, pp=2, microbatches=2)[1]
                                  for ac in (False, True)]
    # recomputation replays the masks: the same weights with and without it
    for name, kw in {"tp": dict(tp=2), "sp": dict(tp=2, sp=True), "pp": dict(pp=2, microbatches=2)}.items():
        out[f"recompute_{name}"] = [_fit(world, DropLM(), activation_checkpointing=ac, **kw)[1] for ac in (False, True)]
    hf = {}
    for ckpt in (False, True):
        model = _hf_gpt2(ckpt)
        trainer = L.Trainer(devices=world, strategy=MegaStrategy(tp=2, timeout=60), max_steps=3, **trainer_kwargs())
        trainer.fit(model, TokenData(12, 64, 4))
        hf[ckpt] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["hf"] = hf
    # a checkpoint of the user's own cannot replay the block streams: refused where a block draws
    try:
        _fit(world, DropLM(own_checkpoint=True), tp=2)
        out["own"] = None
    except RuntimeError as e:
        out["own"] = str(e)
    out["own_no_dropout"] = _fit(world, DropLM(p=0.0, own_checkpoint=True), tp=2)[1] is not None
    return out


@pytest.fixture(scope="module")
def checks():
    return dist.run(2, _checks)


def _agree(a, b) -> float:
    return (a == b).float().mean().item()


def test_split_activations_draw_their_own_masks_and_replicated_ones_the_same(checks):
    a, b = checks[0]["tp"], checks[1]["tp"]
    for i in range(2):
        assert _agree(a[f"blocks.{i}.drop_in"], b[f"blocks.{i}.drop_in"]) < 0.7  # independent: about 1/2
        assert torch.equal(a[f"blocks.{i}.drop_out"], b[f"blocks.{i}.drop_out"])  # replicas stay alike
    assert _agree(a["blocks.0.drop_out"], a["blocks.1.drop_out"]) < 0.7


def test_sequence_shards_draw_their_own_masks(checks):
    a, b = checks[0]["sp"], checks[1]["sp"]
    for i in range(2):
        assert a[f"blocks.{i}.drop_out"].shape[1] == SEQ // 2
        assert _agree(a[f"blocks.{i}.drop_out"], b[f"blocks.{i}.drop_out"]) < 0.7
        assert _agree(a[f"blocks.{i}.drop_in"], b[f"blocks.{i}.drop_in"]) < 0.7


def test_pipeline_stages_draw_their_own_masks_and_keep_the_default_generator_alike(checks):
    (m0, rng0), (m1, rng1) = checks[0]["pp"], checks[1]["pp"]
    assert set(m0) >= {"blocks.0.drop_out"} and set(m1) >= {"blocks.1.drop_out", "blocks.2.drop_out"}
    assert _agree(m0["blocks.0.drop_out"], m1["blocks.1.drop_out"]) < 0.7
    # stage 0 runs one block, stage 1 two: the user's generator moves alike all the same
    assert len(rng0) == len(rng1) == 3 and all(torch.equal(a, b) for a, b in zip(rng0, rng1))


def test_blocks_called_piece_by_piece_draw_from_the_stages_stream(checks):
    (m0, rng0), (m1, rng1) = checks[0]["pp_pieces"], checks[1]["pp_pieces"]
    assert set(m0) >= {"blocks.0.0.drop_out", "blocks.0.1.drop_out"} and set(m1) >= {"blocks.2.1.drop_out"}
    assert _agree(m0["blocks.0.0.drop_out"], m1["blocks.1.0.drop_out"]) < 0.7
    assert len(rng0) == len(rng1) == 3 and all(torch.equal(a, b) for a, b in zip(rng0, rng1))


@pytest.mark.parametrize("layout", ["tp", "sp", "pp", "pp_pieces"])
def test_recomputation_draws_the_forwards_masks_again(checks, layout):
    for r in checks:
        plain, recomputed = r[f"recompute_{layout}"]
        assert plain.keys() == recomputed.keys()
        for key in plain:
            torch.testing.assert_close(recomputed[key], plain[key], atol=1e-6, rtol=0, msg=key)


def test_hugging_face_gradient_checkpointing_draws_the_forwards_masks_again(checks):
    for r in checks:
        for key, value in r["hf"][False].items():
            torch.testing.assert_close(r["hf"][True][key], value, atol=1e-6, rtol=0, msg=key)


def test_a_checkpoint_of_ones_own_is_refused_where_a_block_draws(checks):
    for r in checks:
        assert r["own"] is not None and "blocks.1" in r["own"] and "activation_checkpointing=True" in r["own"]
        assert r["own_no_dropout"]


class _InnerCheckpointed(nn.Module):
    """A checkpoint inside a block, around a column -> dropout -> row region (no block hook reruns)."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.fc1, self.drop, self.fc2, self.checkpointed = nn.Linear(8, 16), nn.Dropout(P), nn.Linear(16, 8), checkpointed

    def mlp(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))

    def forward(self, x):
        return x + (checkpoint(self.mlp, x, use_reentrant=False) if self.checkpointed else self.mlp(x))


def test_a_checkpoint_inside_a_block_recomputes_its_split_region_with_the_forwards_masks():
    from lightning_tp.recompute.rng import BlockStreams

    def grads(checkpointed):
        torch.manual_seed(0)
        blocks = nn.ModuleList([_InnerCheckpointed(checkpointed) for _ in range(2)])
        streams = BlockStreams(1, 0, 1, False, torch.device("cpu"))
        streams.install(blocks, [(f"b{i}", b) for i, b in enumerate(blocks)], [(b.fc1, False) for b in blocks],
                        [b.fc2 for b in blocks])
        x = torch.randn(4, 8, requires_grad=True)
        h = x
        for block in blocks:
            h = block(h)
        h.pow(2).sum().backward()
        return [x.grad] + [p.grad for p in blocks.parameters()]

    for plain, recomputed in zip(grads(False), grads(True)):
        torch.testing.assert_close(recomputed, plain, atol=0, rtol=0)
