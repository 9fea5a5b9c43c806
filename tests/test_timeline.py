"""A run's measured pipeline timeline (PipelineTimeline: a Chrome/Perfetto trace) and the planner's predicted
one, both drawn as PNGs."""

import json
import struct
import tempfile

import pytest
import torch

import dist
from examples.gpt.model import GPT, GPTConfig
from lightning_tp.layout_search import plan, trace_png
from lightning_tp.layout_search.estimate import pipeline_seconds

M = 4  # microbatches a step


def _traced(rank, world, path):
    import lightning as L
    import torch.distributed as torch_dist

    from lightning_tp import MegaStrategy, PipelineTimeline
    from models import TokenData, make_model, trainer_kwargs

    torch_dist.init_process_group("gloo")
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(pp=2, microbatches=M, timeout=120), max_steps=4,
                        callbacks=[PipelineTimeline(path, steps=(1, 2))], **trainer_kwargs())
    trainer.fit(make_model("gpt"), TokenData(4 * 8, 64, 8))
    return trainer.global_rank


def _png_size(path) -> tuple:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_a_pp2_run_writes_every_ranks_actions_in_causal_order(tmp_path):
    path = tmp_path / "trace.json"
    dist.run(2, _traced, str(path))
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0: stage 0 (tp 0, dp 0)", 1: "rank 1: stage 1 (tp 0, dp 0)"}
    acts = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    for rank in (0, 1):
        mine = [e for e in acts if e["pid"] == rank]
        kinds = [e["name"] for e in mine]  # two steps recorded (W: the drained split backward's weight halves)
        assert kinds.count("F") == kinds.count("B") == 2 * M and set(kinds) <= {"F", "B", "W"}, kinds
        mine.sort(key=lambda e: e["ts"])  # one action at a time on a rank
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(mine, mine[1:]))
    # each microbatch's forward ends on stage 1 after stage 0 began it, its backward on stage 0 after stage 1
    # began its own (one clock on one machine)
    for step in range(2):
        def at(rank, kind, mb):
            return [e for e in acts if (e["pid"], e["name"], e["args"]["microbatch"]) == (rank, kind, mb)][step]
        for mb in range(M):
            assert at(1, "F", mb)["ts"] + at(1, "F", mb)["dur"] > at(0, "F", mb)["ts"]
            assert at(0, "B", mb)["ts"] + at(0, "B", mb)["dur"] > at(1, "B", mb)["ts"]
    png = tmp_path / "measured.png"
    trace_png(path, png)
    assert _png_size(png) == (1600, 2 * 28 + 10)


def test_the_plans_timeline_of_an_interleaved_pp4_layout():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=16, n_head=16, n_embd=1024, block_size=1024, vocab_size=32000))
    p = plan(model, gpus=32, gpus_per_node=8, global_batch=64, seq_len=1024)
    c = next(c for c in p.fits if c.pp == 4 and c.schedule == "interleaved_1f1b" and c.virtual_stages == 2)
    with tempfile.TemporaryDirectory() as d:
        result = c.timeline_png(f"{d}/t.png")
        assert _png_size(f"{d}/t.png") == (1600, 4 * 28 + 10)
    assert len(result.timelines) == 4
    assert result.makespan == pytest.approx(pipeline_seconds(4, 2, c.microbatches, *c.stage_seconds))
