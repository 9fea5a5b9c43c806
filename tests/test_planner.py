"""The planner: candidates that divide the model and the batch, its pipeline arithmetic against the schedule
replay, its memory against explain, the published Megatron-LM runs, a 175B plan's speed, and bad input."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from examples.gpt.model import GPT, GPTConfig
from lightning_tp import MegaStrategy
from lightning_tp import explain
from lightning_tp.pipeline.schedule.schedules import build_schedule
from lightning_tp.pipeline.schedule.simulate import simulate
from lightning_tp.layout_search import Cluster, plan
from lightning_tp.layout_search.estimate import pipeline_seconds
from lightning_tp.layout_search.profile import profile
from lightning_tp.config import ParallelConfig

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("plan_megatron", ROOT / "bench" / "plan_megatron.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpt(**kw):
    with torch.device("meta"):
        return GPT(GPTConfig(**kw))


@pytest.mark.parametrize("schedule, pp, v, m", [("1f1b", 4, 1, 8), ("1f1b", 2, 1, 5), ("interleaved_1f1b", 4, 2, 8),
                                                ("interleaved_1f1b", 2, 4, 6)])
def test_pipeline_time_is_the_schedule_replayed(schedule, pp, v, m):
    f, b = 3.0, 7.0  # per stage and microbatch; a chunk's is 1/v of it
    replayed = simulate(build_schedule(schedule, pp, m, v), pp, v, {"F": f / v, "B": b / v}).makespan
    assert pipeline_seconds(pp, v, m, f, b) == pytest.approx(replayed)


def test_candidates_divide_the_model_and_the_batch_and_build_a_strategy():
    p = plan(_gpt(n_layer=8, n_head=8, n_embd=256, block_size=512, vocab_size=1024), gpus=16, gpus_per_node=4,
             global_batch=32, seq_len=512)
    assert len(p) > 20
    for c in p.fits + p.overflows:
        assert c.tp * c.cp * c.pp * c.dp == 16 and 8 % c.tp == 0 and 8 % c.pp == 0
        assert c.microbatch_size * c.microbatches * c.dp == 32
        MegaStrategy(**c.strategy_kwargs())  # every option valid
    assert [c.step_s for c in p.fits] == sorted(c.step_s for c in p.fits)
    assert all(c.memory_gib <= 80 for c in p.fits) and all(c.memory_gib > 80 for c in p.overflows)


@pytest.mark.parametrize("tp, sp, ckpt", [(1, False, False), (2, True, False), (2, False, "selective"), (4, True, True)])
def test_activation_memory_is_explains(tp, sp, ckpt):
    """Without a pipeline the planner's activations equal explain's for the same layout (per-process batch)."""
    model = _gpt(n_layer=4, n_head=8, n_embd=128, block_size=256, vocab_size=512)
    p = plan(model, gpus=8, gpus_per_node=8, global_batch=16, seq_len=256, flash=False)
    c = next(c for c in p.fits + p.overflows if (c.tp, c.sp, c.pp, c.activation_checkpointing, c.microbatch_size)
             == (tp, sp, 1, ckpt, 2))
    est = explain(model, tp=tp, sp=sp, batch_shape=(2, 256), dtype_bytes=2, grad_bytes=2, score_copies=3,
                  activation_checkpointing=ckpt, print_report=False).rank(0)
    assert c.memory["activations"] * 2 ** 30 == pytest.approx(est.act_bytes, rel=1e-6)


def test_a_175b_plan_keeps_tp_inside_a_node():  # its time: bench/plan_megatron.py (no test asserts on time)
    model = _gpt(n_layer=96, n_head=96, n_embd=12288, block_size=2048, vocab_size=51200)
    p = plan(model, gpus=1024, gpus_per_node=8, gpu_memory_gib=80, peak_tflops=989, global_batch=1536, seq_len=2048)
    best = p[0]
    assert best.tp <= 8 and best.memory_gib <= 80 and 0 < best.mfu < 1
    assert "lightning_tp plan: 1024 GPUs" in str(p) and "#1:" in str(p)


@pytest.mark.parametrize("row, hf_gpt2", [(0, False), (3, False), (6, False), (0, True), (6, True)])
def test_published_megatron_runs_within_15_percent(row, hf_gpt2):
    """Megatron-LM 2021, Table 1 (1.7B at tp=1, 18.4B at tp=8, 145.6B at tp=8 x pp=8; the full table:
    bench/plan_megatron.py), of the example GPT and of Hugging Face's GPT-2 (Conv1D layers): the per-GPU
    throughput predicted at the published layout."""
    bench = _bench()
    tflops, at, best, _ = bench.predict(bench.TABLE_1[row], hf_gpt2)
    published = bench.TABLE_1[row][-1]
    assert abs(tflops / published - 1) < 0.15, (tflops, published, at)
    assert best.tp <= 8  # the recommended tp stays inside a node


def test_nothing_fits_says_what_overflows():
    with pytest.raises(ValueError, match=r"nothing fits in 0.05 GiB per GPU\. The smallest layout, tp=\d.* needs .* GiB "
                                         r"> 0.05 GiB: weights .*, optimizer .*, activations"):
        plan(_gpt(n_layer=4, n_head=8, n_embd=1024, block_size=1024, vocab_size=512), gpus=8, gpu_memory_gib=0.05,
             global_batch=8, seq_len=1024)
    with pytest.raises(ValueError, match="whole nodes only"):
        Cluster(gpus=12, gpus_per_node=8)
    with pytest.raises(ValueError, match="global_batch=0"):
        plan(_gpt(n_layer=4), gpus=2, global_batch=0)


def test_command_ranks_the_example_configs_model(capsys):
    from lightning_tp.__main__ import main

    config = str(ROOT / "examples" / "gpt" / "config.yaml")
    assert main(["plan", "--config", config, "--gpus", "16", "--global-batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "lightning_tp plan: 16 GPUs (8 a node, 80 GiB, 989 TFLOP/s)" in out and "#1:" in out, out


def test_calibrating_this_machine_gives_a_cluster_plan_takes():
    from lightning_tp.layout_search.calibrate import calibrate

    environ = dict(os.environ)
    cluster = calibrate(world=1)
    assert not torch.distributed.is_initialized()  # the fits it timed leave no process group behind
    assert dict(os.environ) == environ  # nor Lightning's OMP_NUM_THREADS for processes started later
    assert cluster.optimizer_s_per_param > 0 and cluster.compute_slowdown == 1.0
    assert cluster.peak_tflops > 0 and cluster.hbm_gbps > 0 and 0 < cluster.step_overhead_s < 1
    p = plan(_gpt(n_layer=4, n_head=4, n_embd=64, block_size=64), gpus=1, cluster=cluster, global_batch=8, seq_len=64,
             precision="32-true")
    assert p[0].step_s > cluster.step_overhead_s


def test_timed_plan_uses_the_blocks_timed_here(monkeypatch):
    from lightning_tp.layout_search import search
    from lightning_tp.layout_search.timing import time_blocks

    model = _gpt(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=64)
    got = time_blocks(model, "transformer.h", 32, 64, (1, 2), (False, True), (2,), threads=1, repeat=2)
    assert set(got) == {(t, m, 2) for t in (1, 2) for m in (False, True)} | {("optimizer", 1), ("optimizer", 2)}
    seen = []  # what the timed plan measured, on its 2 processes at once
    monkeypatch.setattr(search, "time_blocks", lambda *a, **kw: seen.append(time_blocks(*a, **kw)) or seen[-1])
    cluster = Cluster(gpus=2, gpus_per_node=2, peak_tflops=1e-6)  # FLOP rates this slow would take hours a step
    kw = dict(gpus=2, cluster=cluster, global_batch=4, seq_len=32, precision="32-true", recompute=(False,))
    flops, timed = plan(model, **kw), plan(model, **kw, timed=True)  # (one recompute mode: a third of the timing)
    assert timed[0].step_s < 10 < flops[0].step_s
    together = seen[0]
    assert {k for k in together if k[0] == "optimizer"} == {("optimizer", 1), ("optimizer", 2)}
    assert {k[:2] for k in together if k[0] != "optimizer"} == {(1, False), (2, False)}, together
    for times, at_once in ((got, False), (together, True)):
        assert 0 < times["optimizer", 1] < 1e-6 and 0 < times["optimizer", 2] < 1e-6  # AdamW's s per parameter
        blocks = {k: v for k, v in times.items() if k[0] != "optimizer"}
        for key, (*seconds, flag) in blocks.items():  # each a median difference: zero where noise outweighs a
            assert min(seconds) >= 0 and sum(seconds) > 0 and flag == at_once, (key, times)  # tiny block


    class DictOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.blocks = torch.nn.Embedding(8, 4), torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            x = self.emb(x)
            for b in self.blocks:
                x = b(x)
            return {"out": x}

    with pytest.raises(ValueError, match=r"timed=True\): the model's forward on token ids returned dict"):
        time_blocks(DictOut(), "blocks", 4, 8, (1,), (False,), (1,), threads=1, repeat=1)


def test_experts_split_over_ep_as_explain_and_the_strategy_do():
    model = _gpt(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=64, n_expert=4, n_expert_per_token=2)
    dense = _gpt(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=64)
    p = plan(model, gpus=8, global_batch=16, seq_len=32, precision="32-true")
    found = {(c.tp, c.pp, c.dp, c.ep) for c in p.fits}
    assert {(1, 1, 8, e) for e in (1, 2, 4)} <= found and not any(e == 8 for *_, e in found)  # ep divides 4 experts
    assert all(c.tp * c.cp * c.dp % c.ep == 0 and (c.zero != 3 or c.ep == 1) for c in p.fits)  # a stage's ranks
    assert any(c.ep > c.dp for c in p.fits)  # experts beyond dp: ep over tp ranks too
    for ep, tp in ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4)):
        c = p.find(tp=tp, pp=1, ep=ep, zero=0)
        r = explain(model, tp=tp, ep=ep, dp=c.dp, batch_shape=(16 // c.dp, 32), print_report=False).rank(0)
        assert c.memory["weights"] * 2 ** 30 == pytest.approx(r.params * 4)  # this rank's experts: 1/ep of them
        ParallelConfig.resolve(**c.strategy_kwargs()).with_world(c.tp * c.pp * c.dp)  # MegaStrategy takes it
        assert (c.why["ep_all_to_all"] > 0) == (ep > 1) and c.strategy_kwargs().get("ep", 1) == ep
    # a token runs 2 of the 4 experts: the block's FLOPs count two MLPs, as the dense model's one
    mlp = 2 * 2 * 64 * 256
    assert profile(model, 32, (1,)).block_flops - profile(dense, 32, (1,)).block_flops == pytest.approx(mlp + 2 * 64 * 4)


def test_backward_hides_the_share_of_dp_buckets_the_cluster_overlaps():
    from lightning_tp.dp.grads import BUCKET_BYTES

    model = _gpt(n_layer=4, n_head=8, n_embd=512, block_size=64)  # fp32 gradients over two 25 MiB buckets
    exposed = {}
    for share in (1.0, 0.5, 0.0):
        cluster = Cluster(gpus=2, gpus_per_node=2, peak_tflops=1e-3, comm_overlap=share)  # a backward long enough
        c = plan(model, gpus=2, cluster=cluster, global_batch=8, seq_len=64, precision="32-true",
                 zeros=(0,)).find(tp=1, pp=1, dp=2, microbatch_size=4, activation_checkpointing=False)
        grads = sum(p.numel() for p in model.parameters()) * 4
        assert BUCKET_BYTES < grads < 2 * BUCKET_BYTES
        whole = cluster.collective_seconds("dp_all_reduce", grads, 2)
        exposed[share] = c.why["dp_exposed"]
        last = (grads - BUCKET_BYTES) / grads
        assert c.stage_seconds[1] > whole  # to cover the first bucket's all-reduce, where the cluster overlaps
        assert exposed[share] == pytest.approx(whole * (last + (1 - last) * (1 - share)))
    assert exposed[1.0] < exposed[0.5] < exposed[0.0]


def test_hf_gpt2_conv1d_blocks_read_as_the_example_gpts_linear_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(n_layer=4, n_head=8, n_embd=256, n_positions=512, vocab_size=1024))
    ours = profile(_gpt(n_layer=4, n_head=8, n_embd=256, block_size=512, vocab_size=1024), 512, (1, 2))
    theirs = profile(hf, 512, (1, 2))
    assert theirs.hidden == ours.hidden == 256
    assert theirs.block_flops == pytest.approx(ours.block_flops) and theirs.core_flops == ours.core_flops
    assert plan(hf, gpus=16, global_batch=32, seq_len=512)[0].step_s > 0


def test_tp_groups_stay_in_whole_nodes():
    """tp=6 on 8-GPU nodes would straddle them: not a candidate, and a group that does is priced across nodes."""
    cluster = Cluster(gpus=48, gpus_per_node=8)
    assert cluster.link(6, 1) == cluster.link(16, 1) == (cluster.inter_node_gbps, cluster.latency_us * 1e-6)
    assert cluster.link(4, 2)[0] == cluster.link(8, 1)[0] == cluster.intra_node_gbps
    assert Cluster(gpus=6, gpus_per_node=8).link(6, 1)[0] == cluster.intra_node_gbps  # one node: all inside
    p = plan(_gpt(n_layer=4, n_head=48, n_embd=768, block_size=256, vocab_size=512), gpus=48, gpus_per_node=8,
             global_batch=48, seq_len=256)
    assert {c.tp for c in p.fits + p.overflows} == {1, 2, 4, 8, 16}


def test_a_model_whose_tp_plan_is_refused_is_planned_without_tp():
    """A config plan with a style the strategy refuses at tp > 1 (Llama-4's packed_rowwise): the other axes are
    ranked, and the plan says which tp sizes were left out and why."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4)
    config.base_model_tp_plan = dict(config.base_model_tp_plan, **{"layers.*.self_attn.o_proj": "packed_rowwise"})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="not supported yet"):
        explain(model, tp=2, batch_shape=(1, 64), print_report=False)  # what the strategy says at tp=2
    p = plan(model, gpus=8, global_batch=16, seq_len=64)
    assert {c.tp for c in p.fits + p.overflows} == {1} and {c.pp for c in p.fits} >= {1, 2, 4}
    assert len(p.left_out) == 1 and p.left_out[0].startswith("tp=2, 4 left out") and "not supported" in p.left_out[0]
    assert p.left_out[0] in str(p)


def test_a_plans_warning_is_said_once_per_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(n_layer=3, n_head=4, n_embd=64, n_positions=64, vocab_size=128))
    with pytest.warns(UserWarning) as said:
        plan(hf, gpus=4, global_batch=8, seq_len=64)
    norms = [str(w.message) for w in said if "norms without a style: ['transformer.ln_f']" in str(w.message)]
    assert len(norms) == 1, norms


def test_a_sequence_too_long_for_one_rank_is_planned_with_context_parallelism():
    """cp divides activation memory per rank: where no cp=1 layout fits a 131072-token sequence, cp does."""
    model = _gpt(n_layer=4, n_head=1, n_embd=512, block_size=131072, vocab_size=1024)  # one head: tp=1 only
    roomy = plan(model, gpus=4, global_batch=4, seq_len=131072, gpu_memory_gib=1000, recompute=(False,), zeros=(0,))
    one, four = roomy.find(cp=1, pp=1, microbatch_size=1), roomy.find(cp=4, pp=1, microbatch_size=1)
    assert four.memory["activations"] == pytest.approx(one.memory["activations"] / 4)
    tight = plan(model, gpus=4, global_batch=4, seq_len=131072, gpu_memory_gib=(one.memory_gib + four.memory_gib) / 2,
                 recompute=(False,), zeros=(0,))
    assert tight.fits[0].cp > 1 and not any(c.cp == 1 and c.pp == 1 for c in tight.fits)
    assert tight.fits[0].strategy_kwargs()["cp"] == tight.fits[0].cp
    assert tight.fits[0].trainer_kwargs()["devices"] == 4
