"""The README's multi-node recipe as a two-"node" job on one machine: two torchrun agents (2 processes
each) meet through the c10d rendezvous, as two hosts would, and train the example GPT from its
LightningCLI config with tp=2 inside each node and pp=2 across them. Each rank records its node, its
groups and its per-step losses; the losses must match one plain single-device process within 1e-5."""

import json
import os
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import dist
from dist import stop_agents as _stop

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "gpt", "config.yaml")
STEPS, TOL, TIMEOUT = 3, 1e-5, 120  # the job takes ~15 s; a hang fails after TIMEOUT
TINY = ["--trainer.max_steps", str(STEPS), "--model.n_layer", "2", "--model.n_embd", "32",
        "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


class RecordRank(L.Callback):
    """In the workers (given by class path on the command line): this rank's node, groups and per-step
    train_loss, written to $MULTINODE_OUT/<global rank>.json when training ends."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer, pl_module):
        import torch.distributed as tdist

        mesh = trainer.strategy.mesh
        record = {"rank": trainer.global_rank, "world": trainer.world_size, "node_rank": trainer.node_rank,
                  "local_rank": trainer.local_rank, "group_rank": int(os.environ["GROUP_RANK"]),
                  "agent": int(os.environ["MULTINODE_AGENT"]), "losses": self.losses,
                  "tp": tdist.get_process_group_ranks(mesh.tp_group),
                  "pp": tdist.get_process_group_ranks(mesh.pp_group)}
        with open(os.path.join(os.environ["MULTINODE_OUT"], f"{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


class LoggedLosses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _two_node_job(tmp_path):
    """Two torchrun agents, as the README launches one per host; returns each rank's record."""
    out = tmp_path / "ranks"
    out.mkdir()
    port = dist.free_port()
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
               os.path.join(ROOT, "examples", "gpt", "train.py"), "fit", "--config", CONFIG,
               "--trainer.num_nodes", "2", "--trainer.devices", "2",
               "--trainer.strategy.init_args.tp", "2", "--trainer.strategy.init_args.pp", "2",
               "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false",
               "--trainer.callbacks+=test_multinode.RecordRank", *TINY]
    env = {**os.environ, "MULTINODE_OUT": str(out),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(ROOT, "tests"), ROOT,
                                                              os.environ.get("PYTHONPATH")]))}
    agents, logs = [], []
    try:
        for agent in range(2):
            log = open(tmp_path / f"agent{agent}.log", "w+")
            logs.append(log)
            agents.append(subprocess.Popen(command, cwd=ROOT, env={**env, "MULTINODE_AGENT": str(agent)},
                                           stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT
        while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
            if any(a.returncode not in (None, 0) for a in agents):
                break  # one node failed: the other would wait for its peers until the deadline
            time.sleep(0.2)
        codes = [a.poll() for a in agents]
    finally:
        _stop(agents)
    text = []
    for i, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- agent {i} (exit {codes[i]}) ---\n{log.read()[-6000:]}")
        log.close()
    assert codes == [0, 0], ("the two-node job " + ("timed out" if None in codes else "failed") + ":\n"
                             + "\n".join(text))
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(4)]


def _one_process():
    """The same config, model and seed on one device with Lightning's default strategy; batches in the
    order Lightning's DistributedSampler gives the job's one data-parallel replica (same seed)."""
    from examples.gpt.lit import ShakespeareData
    from examples.gpt.train import main

    cli = main(["--config", CONFIG, "--trainer.devices", "1", "--trainer.strategy", "auto",
                "--trainer.logger", "false", *TINY], run=False)
    data = cli.datamodule
    data.setup()

    class OneReplicaOrder(ShakespeareData):
        def setup(self, stage=None):
            pass

        def train_dataloader(self):
            sampler = DistributedSampler(data.train_set, num_replicas=1, rank=0, shuffle=True, seed=0)
            return DataLoader(data.train_set, batch_size=data.batch_size, sampler=sampler, drop_last=True)

    rec = LoggedLosses()
    cli.trainer.callbacks.append(rec)
    cli.trainer.fit(cli.model, OneReplicaOrder(data.block_size, data.batch_size))
    return rec.losses


def test_two_nodes_tp_inside_pp_across_match_one_process(tmp_path):
    records = _two_node_job(tmp_path)
    by_rank = {r["rank"]: r for r in records}
    assert all(r["world"] == 4 for r in records)
    for r in records:  # Lightning's node and local rank are torchrun's, and rank = node * 2 + local
        assert (r["node_rank"], r["rank"]) == (r["group_rank"], 2 * r["group_rank"] + r["local_rank"]), r
    # tp is the fastest index: {0, 1} and {2, 3}, each the two processes of one agent (one "host")
    assert sorted(tuple(r["tp"]) for r in records) == [(0, 1), (0, 1), (2, 3), (2, 3)]
    for r in records:
        assert {by_rank[q]["agent"] for q in r["tp"]} == {r["agent"]}, records
    # pp spans the nodes: stage 0 on one agent, stage 1 on the other
    assert sorted(tuple(r["pp"]) for r in records) == [(0, 2), (0, 2), (1, 3), (1, 3)]
    for r in records:
        assert len({by_rank[q]["agent"] for q in r["pp"]}) == 2, records

    expected = _one_process()
    assert len(expected) == STEPS
    for r in records:  # every rank reports the loss a logger on rank 0 would show
        assert len(r["losses"]) == STEPS, r
        diff = max(abs(a - b) for a, b in zip(r["losses"], expected))
        assert diff < TOL, f"rank {r['rank']}: {r['losses']} vs one process {expected}"
    assert torch.isfinite(torch.tensor(expected)).all()
