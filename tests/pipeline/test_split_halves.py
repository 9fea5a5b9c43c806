"""This project's custom autograd Functions (Triton kernels, QAT) under a split backward: B keeps their
weight gradients for W, which re-runs no input-gradient work; the numbers equal the unsplit backward's."""

import lightning as L
import torch
import torch.distributed as torch_dist

import dist
from lightning_tp import MegaStrategy
from lightning_tp.pipeline.run import backward_phase
from models import LossRecorder, TokenData, make_model, trainer_kwargs

STEPS = 3
# name: (model kwargs, strategy kwargs); the Triton kernels run in the interpreter (TRITON_INTERPRET=1)
RUNS = {
    "kernels": (dict(n_layer=2), dict(kernels=True)),
    "int8": (dict(n_layer=2, quant="int8"), dict(quant="int8")),
}


def _fit(rank, world):
    torch_dist.init_process_group("gloo")
    out = {}
    for name, (model_kw, strategy_kw) in RUNS.items():
        for split in ("drain", False):
            before = dict(backward_phase.COUNTS)
            rec = LossRecorder()
            trainer = L.Trainer(devices=world, max_steps=STEPS, callbacks=[rec], **trainer_kwargs(),
                                strategy=MegaStrategy(pp=2, microbatches=2, split_backward=split, timeout=120,
                                                      **strategy_kw))
            model = make_model("gpt", **model_kw)
            trainer.fit(model, TokenData(STEPS * 4, 64, 4))
            fused = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Fused")})
            out[(name, split)] = dict(losses=rec.losses, fused=fused,
                                      counts={k: backward_phase.COUNTS[k] - before[k] for k in before},
                                      weights={k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def test_w_reruns_no_input_gradient_work_of_this_projects_functions():
    results = dist.run(2, _fit, timeout=600)
    for name in RUNS:
        for rank, r in enumerate(results):
            split, whole = r[(name, "drain")], r[(name, False)]
            assert split["counts"]["inputs_again"] == 0, (name, rank, split["counts"])
            if rank == 1:  # the stage that receives: its B takes the input gradient, W the weights' (kept
                # by B where one kernel computes both, else computed alone: the QAT matmul's)
                assert split["counts"]["kept" if name == "kernels" else "deferred"] > 0, (name, split["counts"])
            assert torch.allclose(torch.tensor(split["losses"]), torch.tensor(whole["losses"]), atol=1e-6, rtol=0)
            for key, value in split["weights"].items():
                assert torch.allclose(value, whole["weights"][key], atol=1e-6, rtol=0), (name, key)
    assert {"FusedLayerNorm", "FusedBiasGeLU"} <= set(results[0][("kernels", "drain")]["fused"])
