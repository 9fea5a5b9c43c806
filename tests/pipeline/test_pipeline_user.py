"""What users write that a pipeline must take as it is, or refuse with a clear message: steps without
``batch_idx``, several validation loaders, dict outputs, ``reduce_fx="sum"`` logs, blocks called by
keyword in any order, modules registered out of running order (OPT), and what cannot travel between
stages (a value residual given to every block, an MoE block's auxiliary loss, a head computed with the
embedding's weight). Staged in one process where a forward is enough; one 2-process launch for what
needs Lightning around it, each case against the same module on one process."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dist
from helpers import NET_HIDDEN, NET_SEQ, NET_VOCAB, Net, NetBlock, net_loader
from lightning_tp import MegaStrategy
from lightning_tp.pipeline.run.microbatch import merge_outputs
from lightning_tp.pipeline.cut.placeholders import OnAnotherStage
from lightning_tp.pipeline.run.side_inputs import SideInputCheck
from lightning_tp.pipeline.cut.outer_modules import outer_groups
from lightning_tp.pipeline.cut.split import apply_split, plan_stages
from lightning_tp.pipeline.run.stage import install
from lightning_tp.pipeline.run.stage_state import StageDone

V, H, T = NET_VOCAB, NET_HIDDEN, NET_SEQ


class NormInHelper(Net):
    """The final norm registered before the blocks and called in a method of the model's own (read too)."""

    def __init__(self):
        super().__init__(layout="norm_elsewhere")

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.finish(h)


def _finish(model, h):
    return model.head(model.norm(h))


class NormElsewhere(NormInHelper):
    """... and called by a function outside the model: its place cannot be read."""

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return _finish(self, h)


class SequentialNet(Net):
    """The blocks in an ``nn.Sequential`` called as a whole, inside the calls of the final norm
    (registered before the blocks) and the head."""

    def __init__(self):
        super().__init__(layout="norm_first")
        self.blocks = nn.Sequential(*self.blocks)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.emb(x))))


class DictNet(Net):
    """The blocks in an ``nn.ModuleDict`` walked in order (torchtitan's ``for layer in self.layers.values()``)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({f"layer{i}": block for i, block in enumerate(self.blocks)})

    def forward(self, x):
        h = self.emb(x)
        for layer in self.blocks.values():
            h = layer(h)
        return self.head(self.norm(h))


class OverlapNet(Net):
    """No embedding: the blocks are fed one view of a tensor made from the batch, and the head is given
    another, overlapping one (h = block(h) alone between them: the stage's first block must not write
    into the view)."""

    def forward(self, x):
        full = F.one_hot(x, V).float()
        h, side = full[..., :H], full[..., 4:4 + H]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h + side))


class ScaledNet(Net):
    """The embedding scaled by a weight of the root module (every stage holds it), a residual around
    each block: on stage 1 what the code computed before the stage's first block is stand-ins, and
    no NaN gradient may reach that weight from there."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        h = self.emb(x) * self.scale
        for block in self.blocks:
            h = h + 0.5 * block(h)
        return self.head(self.norm(h))


class AttributeReadNet(Net):
    """The input projection called with an argument that reads a block's attribute: still before them."""

    def __init__(self):
        super().__init__(layout="in_proj")

    def forward(self, x):
        h = self.emb(x)
        h = self.project_in(h if self.blocks[0].fc.bias is not None else -h)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class PiecesNet(Net):
    """Each block an ``nn.ModuleList`` of two pieces the loop calls one by one, with the residuals
    around them (``for norm, fc in self.blocks``), as many research models write it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.ModuleList([nn.LayerNorm(H), nn.Linear(H, H)]) for _ in range(4))

    def forward(self, x):
        h = self.emb(x)
        for norm, fc in self.blocks:
            h = norm(h) + h
            h = fc(h) + h
        return self.head(self.norm(h))


class ZipNet(Net):
    """A norm per block in a list of its own, walked with the blocks (``zip(self.blocks, self.norms)``);
    ``norms_first``: that list registered first (a tie by length went to it); ``heads``: another list
    as long, used after the loop (not walked with the blocks)."""

    def __init__(self, norms_first=False, heads=False):
        super().__init__()
        del self.blocks
        torch.manual_seed(0)
        if norms_first:
            self.norms = nn.ModuleList(nn.LayerNorm(H) for _ in range(4))
        self.blocks = nn.ModuleList(NetBlock() for _ in range(4))
        if not norms_first:
            self.norms = nn.ModuleList(nn.LayerNorm(H) for _ in range(4))
        if heads:
            self.heads = nn.ModuleList(nn.Linear(H, V) for _ in range(4))

    def forward(self, x):
        h = self.emb(x)
        for block, norm in zip(self.blocks, self.norms):
            h = h + block(norm(h))
        out = self.head(self.norm(h))
        return out + sum(head(h) for head in self.heads) if hasattr(self, "heads") else out


def _staged(base, x, grad=True, models=None):
    """pp=2 in one process: stage 0's output feeds stage 1, which returns the model's output; the
    blocks' other arguments are checked across the stages through an in-process store. ``models``:
    a list that gets each stage's model."""
    message, side = None, SideInputCheck(torch.distributed.HashStore(), lambda k: k % 2)  # as both ranks' own
    for rank in (0, 1):
        model = copy.deepcopy(base)
        if models is not None:
            models.append(model)
        layout = plan_stages(model, 2)
        split = apply_split(model, layout, rank)
        state = install(layout.blocks(model), layout, rank,
                        [(model.get_submodule(n), twin, runs) for n, (twin, runs) in split.silence.items()],
                        side=side)
        state.run.vstage, state.run.activation = rank, message
        with torch.set_grad_enabled(grad):
            try:
                out = model(x)
            except StageDone as done:
                message = done.output.detach().requires_grad_(grad)
    return out


def _x():
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("style, layout", [("keywords", "plain"), ("plain", "in_proj"), ("plain", "norm_first"),
                                           ("plain", "norm_in_helper"), ("plain", "sequential"), ("plain", "dict"),
                                           ("plain", "overlap"), ("plain", "scaled"), ("plain", "pieces"),
                                           ("plain", "zip"), ("plain", "zip_norms_first")])
def test_staged_runs_match_the_unsplit_model(style, layout):
    model = {"norm_in_helper": NormInHelper, "sequential": SequentialNet, "dict": DictNet, "overlap": OverlapNet,
             "scaled": ScaledNet, "pieces": PiecesNet, "zip": ZipNet,
             "zip_norms_first": lambda: ZipNet(norms_first=True)}.get(layout, lambda: Net(style, layout))()
    torch.testing.assert_close(_staged(model, _x()), model(_x()), atol=1e-6, rtol=0)


def test_a_stage_sends_where_it_stops_and_waits_for_its_input_at_its_first_block():
    """The executor (gloo) hands a run the send of its result, made where the stage stops, and the
    wait for its received activation, made at the stage's first block: the user's code before the
    blocks (here the embedding's placeholder) runs while the transfer is in flight. The received
    buffer holds NaN until that wait fills it, as gloo's would hold garbage: a block reading it
    earlier would give NaN."""
    base, x = Net(), _x()
    models, sent, events = [], [], []
    for rank in (0, 1):
        model = copy.deepcopy(base)
        models.append(model)
        layout = plan_stages(model, 2)
        split = apply_split(model, layout, rank)
        state = install(layout.blocks(model), layout, rank,
                        [(model.get_submodule(n), twin, runs) for n, (twin, runs) in split.silence.items()])
        state.run.vstage = rank
        if rank == 0:
            state.run.send_at_stop = sent.append
            with pytest.raises(StageDone) as stop:
                model(x)
            assert len(sent) == 1 and sent[0] is stop.value.output and state.run.send_at_stop is None
            continue
        buffer = torch.full_like(sent[0], float("nan"))
        state.run.activation = buffer

        def arrive():
            events.append("arrived")
            buffer.copy_(sent[0].detach())

        state.run.activation_wait = arrive
        model.emb.register_forward_hook(lambda *_: events.append("before the blocks"))
        out = model(x)
    assert events == ["before the blocks", "arrived"] and state.run.activation_wait is None
    torch.testing.assert_close(out, base(x), atol=1e-6, rtol=0)


def test_lists_walked_with_the_blocks_go_with_them():
    for norms_first in (False, True):
        layout = plan_stages(ZipNet(norms_first), 2)
        assert (layout.blocks_path, layout.companions) == ("blocks", ("norms",))  # the heavier list is the blocks
        model = ZipNet(norms_first)
        apply_split(model, layout, 1)
        assert [type(m).__name__ for m in model.norms] == ["SkippedBlock"] * 2 + ["LayerNorm"] * 2
    assert plan_stages(ZipNet(heads=True), 2).companions == ("norms",)  # as long, but not walked with them


class ConditionedNet(ZipNet):
    """A list walked with the blocks whose modules are called on a condition before each block (FiLM):
    a stage starts, and stops, at the first piece given hidden states, not at ``mod(self.c)``."""

    def __init__(self):
        super().__init__()
        del self.norms
        self.mods = nn.ModuleList(nn.Linear(H, H) for _ in range(4)).requires_grad_(False)
        self.register_buffer("c", torch.randn(H, generator=torch.Generator().manual_seed(2)))

    def forward(self, x):
        h = self.emb(x)
        for block, mod in zip(self.blocks, self.mods):
            h = block(h, x0=mod(self.c))
        return self.head(self.norm(h))


def test_a_stage_starts_and_stops_at_the_first_piece_given_hidden_states():
    model = ConditionedNet()
    assert plan_stages(model, 2).companions == ("mods",)
    torch.testing.assert_close(_staged(model, _x()), model(_x()), atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(_staged(model, _x(), grad=False), model(_x()), atol=1e-6, rtol=0)


class IndexedNormsNet(ZipNet):
    def forward(self, x):
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            h = h + block(self.norms[i](h))
        return self.head(self.norm(h))


def test_a_list_indexed_inside_the_loop_is_refused_naming_zip():
    with pytest.raises(ValueError, match=r"norms\.0 went to the last stage.*zip\(self\.blocks, self\.norms\)"):
        _staged(IndexedNormsNet(), _x())


def test_stand_ins_before_a_stages_first_block_send_no_gradient_to_weights_every_stage_holds():
    stages = []
    _staged(ScaledNet(), _x(), models=stages).sum().backward()
    grads = [p.grad for p in stages[1].parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert stages[1].scale.grad is None  # made on stage 0; on stage 1 only stand-ins went through it


def test_modules_go_where_the_parents_code_calls_them():
    for model, before, after in ((Net(layout="in_proj"), ["emb", "project_in"], ["norm", "head"]),
                                 (Net(layout="norm_first"), ["emb"], ["norm", "head"]),
                                 (SequentialNet(), ["emb"], ["norm", "head"]),  # norm(blocks(h)): after them
                                 (AttributeReadNet(), ["emb", "project_in"], ["norm", "head"])):
        groups = outer_groups(model, ["blocks"])
        assert [n for n, _ in groups["before"]] == before and [n for n, _ in groups["after"]] == after, model


def test_opt_final_norm_and_projections_go_where_they_run():
    transformers = pytest.importorskip("transformers")
    config = transformers.OPTConfig(vocab_size=V, hidden_size=H, ffn_dim=16, num_hidden_layers=2,
                                    num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=4)
    groups = outer_groups(transformers.OPTForCausalLM(config), ["model.decoder.layers"])
    assert [n for n, _ in groups["before"]] == ["model.decoder.embed_tokens", "model.decoder.embed_positions",
                                                "model.decoder.project_in"]
    assert sorted(n for n, _ in groups["after"]) == ["lm_head", "model.decoder.final_layer_norm",
                                                     "model.decoder.project_out"]


def test_the_pipeline_block_list_is_an_outermost_one():
    class MoE(nn.Module):  # 2 blocks of 4 experts each: the experts are no pipeline stages
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(4))

    model = nn.Module()
    model.blocks = nn.ModuleList(MoE() for _ in range(2))
    assert plan_stages(model, 2).blocks_path == "blocks"


def test_explain_names_module_dict_blocks_by_their_keys():
    from lightning_tp import explain

    assert explain(DictNet(), pp=2, batch_shape=(2, T), print_report=False).stages == [(0, 0, 0, 1), (1, 1, 2, 3)]


def test_an_nn_sequential_or_module_dict_of_blocks_is_the_block_list_where_no_module_list_is():
    model = nn.Module()
    model.mlp = nn.Sequential(nn.Linear(H, H), nn.Linear(H, H))  # layers, not blocks of their own
    model.heads = nn.ModuleDict({"a": nn.Linear(H, H), "b": nn.Linear(H, H)})
    model.stem = nn.Sequential(*(NetBlock() for _ in range(3)))
    model.layers = nn.ModuleDict({f"l{i}": NetBlock() for i in range(4)})
    layout = plan_stages(model, 2)
    assert layout.blocks_path == "layers" and layout.blocks(model).name(3) == "layers.l3"
    model.blocks = nn.ModuleList(NetBlock() for _ in range(2))  # a ModuleList wins, even a shorter one
    assert plan_stages(model, 2).blocks_path == "blocks"
    del model.stem, model.layers, model.blocks
    with pytest.raises(ValueError, match="pipeline_blocks="):
        plan_stages(model, 2)


def test_a_family_plan_names_its_blocks_at_tp1_even_with_styles_it_cannot_shard():
    transformers = pytest.importorskip("transformers")
    from lightning_tp.plans import checks
    from lightning_tp.plans import lookup

    config = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    # a style this project does not map (Llama-4's packed projection): refused at tp > 1
    config.base_model_tp_plan = dict(config.base_model_tp_plan, **{"layers.*.self_attn.o_proj": "packed_rowwise"})
    model = transformers.LlamaForCausalLM(config)
    assert lookup.blocks_path(model, "auto") == "model.layers"
    with pytest.raises(ValueError, match="packed_rowwise"):
        checks.resolve(model, 2, False)


@pytest.mark.parametrize("style, layout, words", [
    ("x0", "plain", r"block 1 is given 'x0' \(shape \(2, 4, 8\)\) besides its hidden states"),
    ("aux", "plain", r"uses output 1 of blocks.0, which is computed on another pipeline stage"),
    ("plain", "norm_elsewhere", r"norm runs after the blocks, but went to the first stage"),
    ("plain", "tied_functional", r"the last stage reads emb.weight after the blocks"),
])
def test_what_cannot_travel_between_stages_is_refused(style, layout, words):
    model = NormElsewhere() if layout == "norm_elsewhere" else Net(style, layout)
    with pytest.raises(ValueError, match=words):
        _staged(model, _x())


class FrozenX0(Net):
    """A value residual made by a frozen embedding (it does not require grad), or drawn at random
    outside the blocks: the next stage would make another one."""

    def __init__(self, kind):
        super().__init__("x0")
        self.kind = kind
        self.emb.weight.requires_grad_(kind != "frozen")

    def forward(self, x):
        h = self.emb(x)
        x0 = torch.randn_like(h) if self.kind == "random" else h
        for block in self.blocks:
            h = block(h, x0=x0)
        return self.head(self.norm(h))


@pytest.mark.parametrize("kind, grad", [("frozen", True), ("trainable", False), ("random", True)])
def test_side_inputs_that_differ_between_stages_are_refused(kind, grad):
    """Refused by comparing what each stage gives block 1 (stage 0's last) besides its hidden states;
    without the check, stage 1 would compute with zeros (or other noise) and say nothing."""
    torch.manual_seed(3)
    with pytest.raises(ValueError, match=r"block 1 is given 'x0' \(shape \(2, 4, 8\)\) besides its hidden states, "
                                         r"and it differs between stage 0 \(sum [-\d.e]+\) and stage 1 \(sum 0\)"
                       if kind != "random" else r"block 1 is given 'x0'.* differs between stage 0"):
        _staged(FrozenX0(kind), _x(), grad=grad)


def test_side_inputs_made_alike_on_every_stage_pass_the_check():
    """A mask and rotary-like tables by keyword, made from the batch and from buffers: the same on
    both stages (Hugging Face's nested position_embeddings=(cos, sin): the pp parity tests)."""
    class Tables(Net):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv", torch.linspace(0.1, 1.0, H))

        def forward(self, x):
            h, mask = self.emb(x), (x > 3).float().unsqueeze(-1)
            pe = (torch.cos(self.inv * x.unsqueeze(-1)), torch.sin(self.inv * x.unsqueeze(-1)))
            for block in self.blocks:
                h = block(h, mask=mask + pe[0] * pe[1])
            return self.head(self.norm(h))

    model = Tables()
    torch.testing.assert_close(_staged(model, _x()), model(_x()), atol=1e-6, rtol=0)


def test_a_missing_auxiliary_output_passes_none_checks_and_fails_any_use():
    aux = OnAnotherStage("output 1 of blocks.0")
    assert aux is not None and isinstance(repr(aux), str)
    for use in (lambda: 1.0 + aux, lambda: aux * 2, lambda: torch.stack([aux]), lambda: aux.mean(),
                lambda: torch.add(torch.ones(()), aux), lambda: bool(aux)):
        with pytest.raises((ValueError, TypeError), match="computed on another pipeline stage|OnAnotherStage"):
            use()


def test_merged_outputs_invert_the_microbatch_split():
    a = {"pred": torch.arange(4).view(2, 2), "loss": torch.tensor(1.0), "n": torch.tensor(3), "tag": "x"}
    b = {"pred": torch.arange(4, 8).view(2, 2), "loss": torch.tensor(3.0), "n": torch.tensor(5), "tag": "x"}
    out = merge_outputs([a, b])
    assert torch.equal(out["pred"], torch.arange(8).view(4, 2)) and out["loss"].item() == 2.0
    assert out["n"].item() == 8 and out["tag"] == "x"
    assert merge_outputs([(torch.ones(1), None), (torch.zeros(1), None)])[1] is None
    assert merge_outputs([["a", "b"], ["c", "d"]]) == ["a", "b", "c", "d"]  # one per sample: joined
    assert merge_outputs([[torch.ones(1), "x"], [torch.zeros(1), "x"]])[1] == "x"  # a structure: by position
    assert merge_outputs([None, None]) is None and merge_outputs([1, 2]) == [1, 2]


# ------------------------------------------------------------------ inside Lightning, pp=2 against one process


class NoBatchIdx(Net):
    def training_step(self, batch):  # Lightning passes batch_idx only where the step takes it
        return super().training_step(batch, 0)


class TwoLoaders(Net):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()) * (1 + dataloader_idx))


class Outputs(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        self.log("tokens", float(x.numel()), reduce_fx="sum")
        self.log("worst", logits.max(), reduce_fx="max")
        return {"loss": loss, "row_mean": logits.mean((1, 2)).detach()}

    def predict_step(self, batch, batch_idx):
        logits = self(batch[0])
        return {"pred": logits.argmax(-1), "logits": logits}


class WithMetrics(Net):
    """The usual torchmetrics accuracies, updated after the forward, one monitored by ModelCheckpoint."""

    def __init__(self):
        super().__init__()
        from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy

        self.train_acc = MulticlassAccuracy(V, average="micro")
        self.val_acc = MulticlassAccuracy(V, average="micro")
        self.val_auroc = BinaryAUROC()  # list states: the last stage's entries travel as they come

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits.flatten(0, 1), y.flatten())
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits.flatten(0, 1), y.flatten())
        self.log("val_acc", self.val_acc)
        self.val_auroc(logits[..., 0].sigmoid().flatten(), (y.flatten() % 2))
        self.log("val_auroc", self.val_auroc)


class EpochEndMetrics(Net):
    """Lightning's usual epoch-end pattern: updated in the step, computed and logged at the epoch's end
    (the first stage never reaches the update)."""

    def __init__(self):
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.val_acc = MulticlassAccuracy(V, average="micro")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc.update(self(x).flatten(0, 1), y.flatten())

    def on_validation_epoch_end(self):
        self.log("val_acc", self.val_acc.compute())
        self.val_acc.reset()


class Seen(L.Callback):
    def __init__(self):
        self.losses, self.outputs = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.outputs.append({k: v.detach().clone() for k, v in outputs.items()} if isinstance(outputs, dict) else None)


def _lightning_cases(world, tmp):
    """Each case's result on this process: pp=2 (world 2) or the same on one process (world 1)."""
    def trainer(callbacks=(), **kw):
        seen = Seen()
        strategy = MegaStrategy(pp=2, microbatches=2, timeout=60) if world == 2 else "auto"
        args = dict(accelerator="cpu", devices=world, strategy=strategy, max_steps=4, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, use_distributed_sampler=False)
        return L.Trainer(callbacks=[seen, *callbacks], **{**args, **kw}), seen

    out = {}
    for name, model in (("no_batch_idx", NoBatchIdx()), ("keywords", Net(style="keywords")), ("opt_like", Net(layout="in_proj"))):
        t, seen = trainer()
        t.fit(model, net_loader())
        out[name] = seen.losses
    t, _ = trainer()
    out["two_loaders"] = t.validate(TwoLoaders(), [net_loader(8, 1), net_loader(8, 1)], verbose=False)
    t, seen = trainer()
    model = Outputs()
    t.fit(model, net_loader())
    out["logged"] = {k: float(v) for k, v in t.callback_metrics.items()}
    out["outputs"] = seen.outputs
    out["predict"] = t.predict(model, net_loader(8, 2))
    # metrics updated after the forward: every stage logs the last stage's, and the monitor finds them
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{tmp}/{world}", monitor="val_acc", mode="max")
    t, _ = trainer([checkpoint], max_steps=-1, max_epochs=2, val_check_interval=2, enable_checkpointing=True,
                   default_root_dir=tmp)
    t.fit(WithMetrics(), net_loader(), net_loader(8, 1))
    out["metrics"] = {k: float(v) for k, v in t.callback_metrics.items()}
    out["best"] = float(checkpoint.best_model_score)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{tmp}/{world}_end", monitor="val_acc", mode="max")
    t, _ = trainer([checkpoint], max_steps=-1, max_epochs=2, val_check_interval=2, enable_checkpointing=True,
                   default_root_dir=tmp)
    t.fit(EpochEndMetrics(), net_loader(), net_loader(8, 1))
    out["epoch_end"] = (float(t.callback_metrics["val_acc"]), float(checkpoint.best_model_score),
                        checkpoint.best_model_path.rpartition("/")[2])
    return out


def _on_rank(rank, world, tmp):
    return _lightning_cases(world, tmp)


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    return dist.run(2, _on_rank, str(tmp_path_factory.mktemp("pp")))


def test_user_steps_run_as_lightning_calls_them(pipelined, tmp_path):
    ref = _lightning_cases(1, str(tmp_path))
    for rank, got in enumerate(pipelined):
        for name in ("no_batch_idx", "keywords", "opt_like"):
            assert len(got[name]) == 4, name
            torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=0, msg=name)
        # the second loader's values are twice the first's: dataloader_idx reached the step
        assert [list(d) for d in got["two_loaders"]] == [list(d) for d in ref["two_loaders"]]
        for g, r in zip(got["two_loaders"], ref["two_loaders"]):
            for key in r:
                assert abs(g[key] - r[key]) < 1e-5, key
        for key in ("tokens", "worst", "train_loss"):  # a count logged with reduce_fx="sum" is the batch's
            assert abs(got["logged"][key] - ref["logged"][key]) < 1e-5, (key, got["logged"], ref["logged"])
        assert ref["logged"]["tokens"] == 4 * T
        # predict: a dict of tensors, joined over microbatches, on every stage
        assert len(got["predict"]) == len(ref["predict"]) == 2
        for g, r in zip(got["predict"], ref["predict"]):
            assert g.keys() == r.keys()
            torch.testing.assert_close(g["logits"], r["logits"], atol=1e-5, rtol=0)
            assert torch.equal(g["pred"], r["pred"])
        # torchmetrics logged after the forward: the same step and epoch values, the same best score
        assert got["metrics"].keys() == ref["metrics"].keys() and "train_acc_epoch" in ref["metrics"]
        for key, value in ref["metrics"].items():
            assert abs(got["metrics"][key] - value) < 1e-6, (key, got["metrics"], ref["metrics"])
        assert abs(got["best"] - ref["best"]) < 1e-6
        # a metric computed at the epoch's end: the last stage's state on every stage (rank 0 logs it)
        assert got["epoch_end"][2] == ref["epoch_end"][2] and ref["epoch_end"][1] > 0
        torch.testing.assert_close(got["epoch_end"][:2], ref["epoch_end"][:2], atol=1e-6, rtol=0)
        # a dict step's other keys reach on_train_batch_end on the last stage, joined over microbatches
        if rank == 1:
            for g, r in zip(got["outputs"], ref["outputs"]):
                assert g.keys() == r.keys() == {"loss", "row_mean"}
                torch.testing.assert_close(g["row_mean"], r["row_mean"], atol=1e-5, rtol=0)


def test_a_metrics_batch_value_is_local_as_its_forwards():
    from torchmetrics import SumMetric

    from lightning_tp.pipeline.run.logs import BatchValues

    values, metric = BatchValues(), SumMetric()
    with values.recording([metric]):
        metric(torch.tensor(2.0))
    assert values.copies[id(metric)]._to_sync is False  # no dp all-gather per step (dist_sync_on_step=False)
    values.finish()
    assert metric._forward_cache.item() == 2.0


def test_a_muted_metric_gets_its_own_update_back():
    """torchmetrics wraps update on the instance (update count, cached value reset): muting it for a
    chunk's run must put that wrapper back, not the class's bare update."""
    from torchmetrics import SumMetric

    from lightning_tp.pipeline.run.logs import muted_metrics

    metric = SumMetric()
    with muted_metrics([metric], True):
        metric.update(torch.tensor(5.0))
    metric.update(torch.tensor(1.0))
    assert metric.compute().item() == 1.0
    metric.update(torch.tensor(2.0))  # the wrapper drops the cached value: compute sees the new update
    assert metric.compute().item() == 3.0 and metric._update_count == 2
