"""ExpertLoad against one process: the tokens each expert took (exact counts), the losses and, for a
router with a correction bias (DeepSeek-V3 on transformers 5.x), the aux-loss-free bias updates."""

import lightning as L
import torch
import torch.distributed as torch_dist

import dist
from lightning_tp import ExpertLoad, MegaStrategy
from models import LossRecorder, TokenData, make_model, trainer_kwargs, transformers_major, vocab_of

STEPS, BATCH = 5, 4
BIASED = "hf_deepseek_v3" if transformers_major() >= 5 else "hf_mixtral"  # a router with a correction bias (5.x)
# name: (world, model kind, layout); Mixtral at tp (counts only)
LAYOUTS = {"ep2": (2, BIASED, dict(ep=2)), "pp2_ep2": (4, BIASED, dict(pp=2, ep=2, microbatches=2)),
           "tp2_sp_ep2": (4, "hf_mixtral", dict(tp=2, sp=True, ep=2)),
           # each expert split over tp: the tp ranks dispatch the same tokens (gathered under sp), counted once;
           # GPT-OSS's experts (5.x) have biases, whose gradient marks must not read as sequence shards
           "tp2_etp2": (2, "hf_gpt_oss" if transformers_major() >= 5 else "hf_mixtral", dict(tp=2, etp=2)),
           "tp2_sp_dp2_ep2_etp2": (4, "hf_mixtral", dict(tp=2, sp=True, ep=2, etp=2)),
           # Switch Transformers: its router's own capacity drops tokens (the last column); under sp every tp rank
           # routes the whole sequence, counted once
           "switch_tp2_sp": (2, "hf_switch", dict(tp=2, sp=True)), "switch_tp2_ep2": (2, "hf_switch", dict(tp=2, ep=2)),
           # etp below tp: on sequence shards the first of each pair counts the pair's gathered tokens
           "tp4_sp_ep2_etp2": (4, ("hf_mixtral", dict(kv_heads=4)), dict(tp=4, sp=True, ep=2, etp=2))}


def _rate(kind) -> float:
    return 0.002 if kind == "hf_deepseek_v3" else 0.0


def _biases(model) -> dict:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
            and not b.is_meta}


class BiasTrace(L.Callback):
    """The correction biases after each step's update (ExpertLoad runs before it)."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.steps.append(_biases(pl_module))


def _fit(kind, trainer, dp, heatmap=None):
    kind, kw = kind if isinstance(kind, tuple) else (kind, {})  # (model kind, its kwargs)
    model = make_model(kind, **kw)
    load, rec, trace = ExpertLoad(every_n_steps=2, heatmap=heatmap, bias_rate=_rate(kind)), LossRecorder(), BiasTrace()
    trainer.callbacks += [load, rec, trace]
    single = trainer.world_size == 1
    trainer.fit(model, TokenData(STEPS * BATCH * dp, vocab_of(model), BATCH * (dp if single else 1), single=single))
    return dict(losses=rec.losses, history=[(s, c.clone()) for s, c in load.history], biases=trace.steps,
                paths=[p for p, _, _ in load.layers])


def _parallel(rank, world, layouts, outdir):
    torch_dist.init_process_group("gloo")
    out = {}
    for name, (_, kind, layout) in layouts.items():
        strategy = MegaStrategy(**layout, timeout=120)
        trainer = L.Trainer(devices=world, strategy=strategy, max_steps=STEPS, limit_val_batches=0, **trainer_kwargs())
        dp = world // (strategy.tp * strategy.pp)
        out[name] = _fit(kind, trainer, dp, heatmap=f"{outdir}/{name}.png")
    return out


def _reference(kind: str, dp: int) -> dict:
    trainer = L.Trainer(devices=1, max_steps=STEPS, limit_val_batches=0, use_distributed_sampler=False,
                        **trainer_kwargs())
    return _fit(kind, trainer, dp)


def test_expert_load_counts_and_bias_updates_equal_one_process(tmp_path):
    for world in (2, 4):
        layouts = {n: c for n, c in LAYOUTS.items() if c[0] == world}
        results = dist.run(world, _parallel, layouts, str(tmp_path), timeout=600)
        for name, (_, kind, layout) in layouts.items():
            dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
            ref = _reference(kind, dp)
            for r in results:
                got = r[name]
                assert [s for s, _ in got["history"]] == [s for s, _ in ref["history"]] == [2, 4], name
                for (_, a), (_, b) in zip(got["history"], ref["history"]):
                    assert torch.equal(a, b), (name, a, b)  # the same tokens went to the same experts
                assert ref["history"][0][1].sum() > 0
                assert (torch.tensor(got["losses"]) - torch.tensor(ref["losses"])).abs().max() < 1e-5, name
                assert len(got["biases"]) == len(ref["biases"]) == STEPS
                for mine, want in zip(got["biases"], ref["biases"]):  # each stage's layers, as one process moved them
                    for key, bias in mine.items():
                        assert torch.allclose(bias, want[key], atol=1e-7), (name, key, bias, want[key])
            held = {k for r in results for k in r[name]["biases"][-1]}
            assert held == set(ref["biases"][-1]), name
            if _rate(kind):  # the rule moved them
                assert any(b.abs().sum() > 0 for step in ref["biases"] for b in step.values())
            png = (tmp_path / f"{name}.png").read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[20:24], "big") == 24 * len(ref["paths"])
