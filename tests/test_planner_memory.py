"""The planner's memory per layout against what a real run of the example GPT holds at its peak (the CPU
tensor bytes alive at once on the heaviest rank, from the profiler): parameters, gradients, optimizer
state and activations together, within 10%, for one process, recomputation, accumulation, tp, sp, pp and dp."""

import pytest
import torch

import dist
from examples.gpt.lit import LitGPT
from lightning_tp.layout_search import plan

CFG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256)  # bench/zero.py's GPT
SEQ, MBS, STEPS = 64, 4, 3
# name: (world, layout fields the plan's candidate must have)
LAYOUTS = {
    "one process": (1, dict(microbatches=1, activation_checkpointing=False)),
    "full recompute": (1, dict(microbatches=1, activation_checkpointing=True)),
    "selective recompute": (1, dict(microbatches=1, activation_checkpointing="selective")),
    "accumulate 2": (1, dict(microbatches=2, activation_checkpointing=False)),
    "tp2 sp": (2, dict(tp=2, sp=True, microbatches=1, activation_checkpointing=False)),
    "tp2": (2, dict(tp=2, sp=False, microbatches=1, activation_checkpointing=False)),
    "dp2 zero1": (2, dict(dp=2, zero=1, microbatches=1, activation_checkpointing=False)),
    "pp2 1f1b m4": (2, dict(pp=2, schedule="1f1b", microbatches=4, activation_checkpointing=False)),
    "pp2 interleaved m4": (2, dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4,
                                   activation_checkpointing=False)),
}


def _candidate(world, layout):
    with torch.device("meta"):
        model = LitGPT(**CFG)
    dp = layout.get("dp", 1)
    ranking = plan(model, gpus=world, gpus_per_node=world, gpu_memory_gib=1e6, global_batch=dp * MBS * layout["microbatches"],
                   seq_len=SEQ, precision="32-true", zeros=(layout.get("zero", 0),))
    return ranking.find(microbatch_size=MBS, **dict(dict(zero=0), **layout))


def _fit(rank, world, runs):
    """Each run's peak tensor bytes on this rank: the model built, fitted STEPS optimizer steps."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_tp import MegaStrategy
    from lightning_tp.layout_search.measure import peak_memory
    from models import Tokens

    out = {}
    for name, (strategy_kw, trainer_kw, batch, batches) in runs.items():
        torch.manual_seed(0)
        with peak_memory() as peak:
            model = LitGPT(**CFG)
            trainer = L.Trainer(accelerator="cpu", strategy=MegaStrategy(timeout=120, **strategy_kw), max_steps=STEPS,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, **trainer_kw)
            data = DataLoader(Tokens(batches * batch * world, CFG["vocab_size"], seq=SEQ), batch_size=batch)
            trainer.fit(model, train_dataloaders=data)
            del trainer, model
        out[name] = peak["bytes"]
    return out


@pytest.fixture(scope="module")
def measured():
    got, predicted = {}, {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        runs = {}
        for name, (w, layout) in LAYOUTS.items():
            if w != world:
                continue
            c = predicted[name] = _candidate(world, layout)
            accumulate = c.microbatches if c.pp == 1 else 1
            batch = MBS * (c.microbatches if c.pp > 1 else 1)  # a step's batch per dp rank
            runs[name] = (c.strategy_kwargs(), c.trainer_kwargs(), batch, STEPS * accumulate)
        for rank, peaks in enumerate(dist.run(world, _fit, runs, timeout=600)):
            for name, b in peaks.items():
                got[name] = max(got.get(name, 0), b)  # the heaviest rank, as the plan counts
    return got, predicted


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_memory_is_within_10_percent_of_the_measured_peak(measured, name):
    got, predicted = measured
    c = predicted[name]
    print(f"{name:>22}: measured {got[name] / 2 ** 20:7.2f} MiB, planned {c.memory_gib * 1024:7.2f} MiB "
          f"({', '.join(f'{k} {v * 1024:.2f}' for k, v in c.memory.items())})")
    assert got[name] == pytest.approx(c.memory_gib * 2 ** 30, rel=0.10), (name, got[name] / 2 ** 20, c.memory)
