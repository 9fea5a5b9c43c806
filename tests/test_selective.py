"""activation_checkpointing="selective": each block's attention core recomputed in backward, nothing else.
Against one process (fp32, 10 AdamW steps, per-step loss and consolidated weights within 1e-5): the example
GPT and Hugging Face Llama (sdpa and eager attention) at tp=2+sp, pp=2 (1F1B, ZB-H1) and tp=2 x pp=2; with
dropout, the same numbers as the same layout without recomputation; the core really recomputed, and its
s² activations no longer stored."""

import pytest
import torch

from helpers import check, train_launch
from models import installed, make_model, runnable, transformers_major

PP = dict(pp=2, microbatches=2)
TEN = dict(max_steps=10)
SEL = dict(activation_checkpointing="selective")
EAGER = dict(config_kw=dict(_attn_implementation="eager"))

WORLD2 = {
    "gpt_tp2_sp": ("gpt", {}, dict(tp=2, sp=True, **SEL), TEN),
    "gpt_pp2_1f1b": ("gpt", {}, dict(PP, **SEL), TEN),
    "gpt_pp2_zb_h1": ("gpt", {}, dict(PP, schedule="zb_h1", **SEL), TEN),
    "llama_tp2_sp": ("hf_llama", {}, dict(tp=2, sp=True, **SEL), TEN),
    "llama_eager_tp2_sp": ("hf_llama", EAGER, dict(tp=2, sp=True, **SEL), TEN),
    "llama_eager_pp2_1f1b": ("hf_llama", EAGER, dict(PP, **SEL), TEN),
    "llama_pp2_zb_h1": ("hf_llama", {}, dict(PP, schedule="zb_h1", **SEL), TEN),
    "litgpt_tp2_sp": ("litgpt", {}, dict(tp=2, sp=True, **SEL), TEN),
    "encoder_tp2": ("encoder", {}, dict(tp=2, **SEL), TEN),  # nn.TransformerEncoder's MultiheadAttention
    "bart_tp2": ("hf_bart", {}, dict(tp=2, **SEL), TEN),  # an encoder-decoder: self- and cross-attention
}
# with dropout (in the attention core too): the same numbers as the same layout without recomputation
DROPOUT = {f"gpt_dropout_tp2_sp_{how}": ("gpt", dict(dropout=0.1), dict(tp=2, sp=True, activation_checkpointing=ac), TEN)
           for how, ac in (("selective", "selective"), ("none", False))}
DROPOUT.update({f"llama_eager_dropout_pp2_zb_h1_{how}": (
    "hf_llama", dict(config_kw=dict(_attn_implementation="eager", attention_dropout=0.1)),
    dict(PP, schedule="zb_h1", activation_checkpointing=ac), TEN) for how, ac in (("selective", "selective"),
                                                                                  ("none", False))})
WORLD2 = runnable(WORLD2)  # litgpt only where it is installed (transformers 4.x)
WORLD4 = {
    "gpt_tp2_pp2": ("gpt", {}, dict(tp=2, **PP, **SEL), TEN),
    "llama_eager_tp2_sp_pp2_zb_h1": ("hf_llama", EAGER, dict(tp=2, sp=True, schedule="zb_h1", **PP, **SEL), TEN),
}


@pytest.fixture(scope="module", autouse=True)
def recompute_fused_cores_too():
    """Selective skips a core SDPA runs fused (it keeps no scores); the tests recompute those too, so the
    dropout-free parity runs go through the checkpoint (the workers inherit the variable)."""
    import os

    os.environ["LIGHTNING_TP_SELECTIVE_FUSED"] = "1"
    yield
    del os.environ["LIGHTNING_TP_SELECTIVE_FUSED"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return train_launch(2, {**WORLD2, **DROPOUT}, tmp_path_factory, "selective2")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return train_launch(4, WORLD4, tmp_path_factory, "selective4")


@pytest.mark.parametrize("name", list(WORLD2))
def test_selective_world2(world2, name):
    check(world2, name, WORLD2, 2)


@pytest.mark.parametrize("name", list(WORLD4))
def test_selective_world4(world4, name):
    check(world4, name, WORLD4, 4)


@pytest.mark.parametrize("model", ["gpt_dropout_tp2_sp", "llama_eager_dropout_pp2_zb_h1"])
def test_with_dropout_selective_gives_the_numbers_of_no_recomputation(world2, model):
    for r in world2:
        sel, none = r[model + "_selective"], r[model + "_none"]
        assert sel["losses"] == none["losses"]
        assert len(set(sel["losses"])) > 5  # dropout on: training moves
    sel, none = world2[0][model + "_selective"]["weights"], world2[0][model + "_none"]["weights"]
    for key, value in none.items():
        assert torch.equal(sel[key], value), key


def _stored_bytes(model, selective_on: bool) -> int:
    """Bytes of the distinct tensors autograd keeps for backward in one training step of ``model``."""
    from lightning_tp.recompute import selective
    from models import Tokens

    if selective_on:
        assert selective.apply(selective.blocks_at(model, selective.places(model))) == 2
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x, y = Tokens(4, 64)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.training_step((x[None].repeat(2, 1), y[None].repeat(2, 1)), 0)
    loss.backward()
    return sum(kept.values())


@pytest.mark.parametrize("kind,kw", [("hf_llama", EAGER), ("hf_llama", dict(config_kw=dict(
    _attn_implementation="eager", attention_dropout=0.1)))], ids=["llama_eager", "llama_eager_dropout"])
def test_the_attention_core_is_not_stored(kind, kw):
    """Per layer the core's probabilities (batch x heads x s x s, fp32) and what derives from them are no
    longer kept: at least one such tensor per layer less."""
    from models import SEQ

    probs = 2 * 4 * SEQ * SEQ * 4  # batch 2, 4 heads
    model = make_model(kind, **kw)
    model.log = lambda *a, **k: None
    plain = make_model(kind, **kw)
    plain.log = model.log
    none, sel = _stored_bytes(plain, False), _stored_bytes(model, True)

    assert none - sel >= 2 * probs, (none, sel, probs)


FAMILIES = [(k, kw) for k, kw in [("gpt", {}), ("hf_llama", {}), ("hf_llama", EAGER), ("hf_gpt2", {}), ("litgpt", {}),
                                   ("encoder", {}), ("demo_transformer", {}), ("hf_bart", {})] if installed(k)]


@pytest.mark.parametrize("kind,kw", FAMILIES, ids=[k + ("_eager" if kw else "") for k, kw in FAMILIES])
def test_each_family_runs_its_attention_core_under_a_checkpoint(kind, kw):
    """The example GPT, Hugging Face sdpa and eager attention, litgpt, nn.MultiheadAttention (its
    F.multi_head_attention_forward's call), BART's self- and cross-attention: one checkpointed core call
    per attention module and step."""
    from lightning_tp.recompute import selective
    from models import Tokens

    model = make_model(kind, **kw)
    model.log = lambda *a, **k: None
    blocks = selective.blocks_at(model, selective.places(model))
    assert selective.apply(blocks) >= 2
    x, y = Tokens(2, 64)[0]
    model.training_step((x[None].repeat(2, 1), y[None].repeat(2, 1)), 0).backward()
    hits = [a._lightning_tp_selective_hits for b in blocks for a in selective.attention_modules(b)]
    assert hits and all(h == 1 for h in hits), hits


@pytest.mark.skipif(transformers_major() >= 5, reason="transformers 5's T5 calls the attention functions; the "
                    "compat environment (transformers 4.x) runs this")
def test_an_attention_written_out_by_hand_is_named_in_a_warning():
    """T5 (transformers 4.x) computes its attention with matmul and softmax in its own forward: nothing to
    checkpoint there."""
    from lightning_tp.recompute import selective
    from models import Tokens

    model = make_model("hf_t5")
    model.log = lambda *a, **k: None
    selective.apply(selective.blocks_at(model, selective.places(model)))
    x, y = Tokens(2, 64)[0]
    with pytest.warns(UserWarning, match="T5Attention computed its attention without"):
        model.training_step((x[None].repeat(2, 1), y[None].repeat(2, 1)), 0).backward()


# ------------------------------------------------------------------ a custom model names its core in its plan

def hand_core(q, k, v):
    """An attention core written out by hand, a module-level function (what Plan(core='module:function') names)."""
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v


class _Core(torch.nn.Module):
    def forward(self, q, k, v):
        return hand_core(q, k, v)


class HandBlock(torch.nn.Module):
    def __init__(self, d=16, as_module=False):
        super().__init__()
        self.norm, self.qkv, self.out = torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.core = _Core() if as_module else None

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return x + self.out(self.core(q, k, v) if self.core is not None else hand_core(q, k, v))


def _hand_model(as_module=False):
    import lightning as L

    class HandLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)
            self.blocks = torch.nn.ModuleList(HandBlock(as_module=as_module) for _ in range(2))

        def forward(self, x):
            h = self.embed(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return HandLM()


@pytest.mark.parametrize("core,as_module", [("test_selective:hand_core", False), ("core", True)],
                         ids=["function", "module"])
def test_a_plan_names_the_core_of_a_custom_model(core, as_module):
    from lightning_tp.recompute import selective
    from lightning_tp.plans import Plan
    from lightning_tp.plans.lookup import core_of
    from models import Tokens

    plan = Plan(name="hand", blocks="blocks", core=core)
    x, y = Tokens(2, 64)[0]
    batch = (x[None].repeat(2, 1), y[None].repeat(2, 1))
    grads = {}
    for on in (False, True):
        model = _hand_model(as_module)
        model.log = lambda *a, **k: None
        if on:
            named = core_of(model, plan)
            assert named == (core,)
            blocks = selective.blocks_at(model, selective.places(model, name="blocks", core=named))
            assert selective.apply(blocks, named) == 2
        kept = {}
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: kept.__setitem__(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) or t,
                lambda t: t):
            loss = model.training_step(batch, 0)
        loss.backward()
        grads[on] = ({n: p.grad for n, p in model.named_parameters()}, sum(kept.values()))
        if on:
            hits = [getattr(m, "_lightning_tp_selective_hits", 0) for b in blocks for m in b.modules()
                    if getattr(m, "_lightning_tp_selective", False)]
            assert hits == [1, 1], hits
    for name, g in grads[False][0].items():
        assert torch.equal(grads[True][0][name], g), name
    assert grads[True][1] < grads[False][1]  # the softmax's s x s output no longer kept


def test_a_plan_core_that_names_nothing_is_refused():
    from lightning_tp.recompute import selective

    with pytest.raises(ValueError, match="no function 'nope'"):
        selective.places(_hand_model(), name="blocks", core=("test_selective:nope",))
    with pytest.raises(ValueError, match="names no submodule"):
        selective.places(_hand_model(), name="blocks", core=("attn.core",))
    with pytest.raises(ValueError, match="Name the core in your plan"):
        selective.places(_hand_model(), name="blocks")


def _hand_pipeline(rank, world):
    import lightning as L

    from lightning_tp import MegaStrategy
    from lightning_tp.plans import Plan
    from models import LossRecorder, TokenData, trainer_kwargs

    out = {}
    for on in (False, True):
        model, rec = _hand_model(), LossRecorder()
        strategy = MegaStrategy(pp=2, microbatches=2, plan=Plan(name="hand", blocks="blocks",
                                                                core="test_selective:hand_core"),
                                activation_checkpointing="selective" if on else False, timeout=60)
        L.Trainer(devices=world, strategy=strategy, max_steps=4, callbacks=[rec], **trainer_kwargs()).fit(
            model, TokenData(16, 64, 4))
        out[on] = rec.losses
        out[f"hits{on}"] = [getattr(b, "_lightning_tp_selective_hits", None) for b in model.blocks
                            if getattr(b, "_lightning_tp_selective", False)]
    return out


def test_a_plan_core_under_a_pipeline_gives_the_numbers_of_no_recomputation():
    import dist

    for r in dist.run(2, _hand_pipeline, timeout=300):
        assert r[True] == r[False] and len(r[True]) == 4
        assert r["hitsTrue"] == [1], r  # this rank's block (one a stage), its core checkpointed each microbatch


def test_a_core_sdpa_runs_fused_is_not_recomputed(monkeypatch):
    """Without dropout CPU SDPA runs its flash kernel, which keeps no s x s scores: nothing is checkpointed."""
    from lightning_tp.recompute import selective
    from models import Tokens

    monkeypatch.delenv("LIGHTNING_TP_SELECTIVE_FUSED")
    calls = []
    real = selective.checkpoint
    monkeypatch.setattr(selective, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    for dropout, recomputed in ((0.0, 0), (0.1, 2)):  # attention dropout: the math path, one call a block
        calls.clear()
        model = make_model("gpt", dropout=dropout)
        model.log = lambda *a, **k: None
        selective.apply(selective.blocks_at(model, selective.places(model)))
        x, y = Tokens(2, 64)[0]
        model.training_step((x[None].repeat(2, 1), y[None].repeat(2, 1)), 0).backward()
        assert len(calls) == recomputed, (dropout, len(calls))
