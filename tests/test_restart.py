"""A rank killed mid-run under ``torchrun --max-restarts 1``: the job restarts by itself, resumes from the
newest complete checkpoint without a ckpt_path (MegaStrategy(resume="auto")), and ends with the losses
and weights of an uninterrupted run; the same when the rank dies during an asynchronous save, and when a
whole agent is lost (elastic: the job goes on at half the processes). A fresh run starts from scratch.
torchrun's workers fork from a preloaded server (dist.torchrun): the agent and its restarts are torchrun's own."""

import json
import os
import socket
import subprocess
import time

import pytest
import torch

from dist import free_port, stop_agents as _stop, torchrun

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "restart_job.py")
KILL_AT, STEPS, TIMEOUT = 5, 8, 300


def _env(out, kill_at: int, mode: str) -> dict:
    return {**os.environ, "RESTART_OUT": str(out), "RESTART_KILL_AT": str(kill_at), "RESTART_MODE": mode,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(ROOT, "tests"), ROOT, os.environ.get("PYTHONPATH")]))}


def _job(out, kill_at: int, mode: str = "kill"):
    """torchrun --max-restarts 1 of the job on 4 local processes; returns its exit code and log (no worker may
    be left once torchrun returned; its fork server ends by itself within a second or so)."""
    out.mkdir(exist_ok=True)
    command = [*torchrun(), "--standalone", "--nproc-per-node", "4", "--max-restarts", "1", JOB]
    with open(out / "log.txt", "w+") as log:
        agent = subprocess.Popen(command, cwd=ROOT, env=_env(out, kill_at, mode), stdout=log, stderr=subprocess.STDOUT)
        try:
            code = agent.wait(timeout=TIMEOUT)
            deadline = time.monotonic() + 10  # the workers' fork server ends once it sees its agent gone
            while (left := _left_behind(out)) and time.monotonic() < deadline:
                time.sleep(0.2)
        except subprocess.TimeoutExpired:
            code, left = None, []
        finally:
            _stop([agent])
        log.seek(0)
        text = log.read()
        assert not left, f"processes of the job left running after torchrun returned: {left}\n{text[-4000:]}"
        return code, text


def _left_behind(out) -> list:
    """(pid, command line) of each process still running with this job's RESTART_OUT in its environment (/proc)."""
    mark, found = f"RESTART_OUT={out}".encode() + b"\0", []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read() + b"\0":
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        found.append((int(pid), c.read().replace(b"\0", b" ")[:200]))
        except OSError:
            continue
    return found


def _records(out, attempt, world=4):
    return [json.loads((out / f"attempt{attempt}_rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run: its per-step losses (global rank 0's) and final weights."""
    out = tmp_path_factory.mktemp("whole")
    code, log = _job(out, 0)
    assert code == 0, log
    losses = {int(k): v for k, v in _records(out, 0)[0]["losses"].items()}
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses, torch.load(out / "weights.pt")


def _same_weights(out, whole):
    got, ref = torch.load(out / "weights.pt"), whole[1]
    assert set(got) == set(ref)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")


def test_a_killed_rank_restarts_the_job_which_resumes_and_ends_as_an_uninterrupted_run(tmp_path, whole):
    code, log = _job(tmp_path / "killed", KILL_AT)  # and no process of it is left behind
    assert code == 0, log
    first, second = _records(tmp_path / "killed", 0), _records(tmp_path / "killed", 1)
    assert "resuming from" in log and "step=4" in log, log  # the checkpoint of epoch 2, the newest complete one
    reference = whole[0]
    for r in range(4):
        before = {int(k): v for k, v in first[r]["losses"].items()}
        after = {int(k): v for k, v in second[r]["losses"].items()}
        assert max(before) <= KILL_AT and sorted(after) == list(range(5, STEPS + 1)), (before, after)
        for step, loss in {**before, **after}.items():
            assert abs(loss - reference[step]) < 1e-5, (r, step, loss, reference[step])
    _same_weights(tmp_path / "killed", whole)
    killed = next(rec["killed"] for rec in first if "killed" in rec)
    print(f"from the kill to training again: {min(rec['started'] for rec in second) - killed:.1f} s")


def test_a_rank_lost_during_an_asynchronous_save_resumes_from_the_checkpoint_before(tmp_path, whole):
    """The save at step 4 is in flight (its write held back 3 s) when rank 1 dies: its directory stays a
    temporary one, the restart takes step 2's, and the run ends as the uninterrupted one."""
    code, log = _job(tmp_path / "async", 4, "async")
    assert code == 0, log
    assert "resuming from" in log and "step=2" in log, log
    second = _records(tmp_path / "async", 1)
    for r in range(4):
        after = {int(k): v for k, v in second[r]["losses"].items()}
        assert sorted(after) == list(range(3, STEPS + 1)), after
        assert max(abs(loss - whole[0][step]) for step, loss in after.items()) < 1e-5, (r, after)
    _same_weights(tmp_path / "async", whole)


def test_a_stopped_rank_stops_every_rank_within_hang_timeout_and_the_restarted_job_recovers(tmp_path, whole):
    """pp=2 x dp=2: SIGSTOP on global rank 1 (first stage) inside step 5's pipeline (alive, silent; the
    collective timeout is 60 s): its watcher, rank 0, sees its heartbeat unchanged for hang_timeout=15 s
    (three beats) and every rank stops, naming it; torchrun restarts the job, which resumes step 4's
    checkpoint (resharded from pp=2 to the same layout) and ends as the uninterrupted tp=2 run (1e-5)."""
    code, log = _job(tmp_path / "stop", KILL_AT, "stop")
    assert code == 0, log
    assert "global rank 1 (host" in log and "sent no heartbeat" in log and "hang_timeout=15" in log, log
    assert "resuming from" in log and "step=4" in log, log
    first, second = _records(tmp_path / "stop", 0), _records(tmp_path / "stop", 1)
    for r in range(4):
        after = {int(k): v for k, v in second[r]["losses"].items()}
        assert sorted(after) == list(range(5, STEPS + 1))
        assert max(abs(loss - whole[0][step]) for step, loss in after.items()) < 1e-5, (r, after)
    _same_weights(tmp_path / "stop", whole)
    stopped = next(rec["killed"] for rec in first if "killed" in rec)
    print(f"from the stop to training again: {min(rec['started'] for rec in second) - stopped:.1f} s")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_lost_agent_restarts_the_job_on_the_processes_left_at_half_the_dp_with_the_same_global_batch(tmp_path, whole):
    """Two agents (2 processes each, elastic --nnodes 1:2); at step 5 one agent is killed with its workers and
    never comes back. The other restarts alone: tp=2 at dp=1, resharded from step 4's checkpoint, two batches
    accumulated per step (the global batch of dp=2), ending with the uninterrupted 4-process run's weights."""
    out = tmp_path / "elastic"
    out.mkdir()
    port = free_port()
    command = [*torchrun(), "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "last_call_timeout=15", "--monitor-interval", "0.5",
               JOB]
    agents, logs = [], []
    try:
        for agent in range(2):
            logs.append(open(out / f"agent{agent}.log", "w+"))
            agents.append(subprocess.Popen(command, cwd=ROOT, env=_env(out, KILL_AT, "elastic"), stdout=logs[-1],
                                           stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 30  # the second agent joins within last_call_timeout, even on a busy machine
            while agent == 0 and not _listening(port) and time.monotonic() < deadline:  # the store is agent 0's
                time.sleep(0.2)
        code = agents[0].wait(timeout=TIMEOUT)
    finally:
        _stop(agents)
        text = []
        for log in logs:
            log.seek(0)
            text.append(log.read()[-6000:])
            log.close()
    log = "\n---\n".join(text)
    assert code == 0, log
    assert agents[1].returncode == -9, log  # killed with its workers
    first, second = _records(out, 0), _records(out, 1, world=2)
    assert {rec["world"] for rec in first} == {4} and {rec["world"] for rec in second} == {2}, log
    assert not (out / "attempt1_rank2.json").exists()
    assert "resuming from" in log and "step=4" in log and "accumulate_grad_batches is now 2" in log, log
    for rec in first:
        before = {int(k): v for k, v in rec["losses"].items()}
        assert max(abs(loss - whole[0][step]) for step, loss in before.items()) < 1e-5, before
    assert sorted(int(k) for k in second[0]["losses"]) == list(range(4, STEPS + 1))  # by global step at each batch's
    _same_weights(out, whole)  # end: two batches a step, the first of step 5 ends at global step 4
    killed = next(rec["killed"] for rec in first if "killed" in rec)
    print(f"from the lost agent to training again on half the processes: "
          f"{min(rec['started'] for rec in second) - killed:.1f} s")


def _fit(root, resume, steps):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_tp import MegaStrategy
    from models import LossRecorder, TokenData, make_model, trainer_kwargs

    rec = LossRecorder()
    ckpt = ModelCheckpoint(dirpath=root / "checkpoints", every_n_epochs=1, save_top_k=-1)
    trainer = L.Trainer(devices=1, strategy=MegaStrategy(resume=resume), max_epochs=steps // 2, callbacks=[rec, ckpt],
                        **trainer_kwargs(enable_checkpointing=True))
    trainer.fit(make_model("gpt"), TokenData(8, 64, 4))
    return rec.losses


def _fresh_and_resumed(rank, world, root):
    """In a process of its own (the fits' process group must not outlive them): a first run, the same again
    next to its checkpoints, a cut-short copy made, then resume=True, and a longer uninterrupted run."""
    import shutil
    from pathlib import Path

    from lightning_tp.checkpoints.newest import newest_complete

    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):  # a run the user started
        os.environ.pop(name, None)
    root = Path(root)
    out = dict(first=_fit(root, "auto", 4), again=_fit(root, "auto", 4))
    newest = newest_complete([root / "checkpoints"])
    broken = newest.with_name("epoch=9-step=99.ckpt")  # written later, but cut short
    shutil.copytree(newest, broken)
    data = next(p for p in broken.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:10])
    out.update(newest=newest.name, chosen=newest_complete([root / "checkpoints"]).name,
               resumed=_fit(root, True, 6), longer=_fit(root / "whole", "auto", 6))
    return out


def test_a_fresh_run_next_to_checkpoints_starts_afresh_and_resume_true_takes_the_newest_complete(tmp_path):
    import dist

    got = dist.run(1, _fresh_and_resumed, str(tmp_path), timeout=300)[0]
    assert len(got["first"]) == 4
    assert got["again"] == got["first"]  # not restarted by a launcher: from scratch, the same losses
    assert "step=4" in got["newest"], got["newest"]
    assert got["chosen"] == got["newest"]  # the later copy cut short is never the one resumed
    resumed, longer = got["resumed"], got["longer"]  # resume=True: from step 4 on, an uninterrupted run's steps
    assert len(resumed) == 2 and max(abs(a - b) for a, b in zip(resumed, longer[4:])) < 1e-5, (resumed, longer)


def _slurm_fit(rank, world, root, requeued):
    """One task of a 2-task SLURM job (tp=2): the first run has rank 1 alone signalled with SIGUSR1 after step 1
    (SLURM's requeue signal); the requeued run starts again in the same directory."""
    import signal

    import lightning as L

    from lightning_tp import MegaStrategy
    from models import TokenData, make_model, trainer_kwargs, vocab_of

    os.environ.update(SLURM_NTASKS=str(world), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                      SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", SLURM_NODELIST="127.0.0.1", SLURM_NNODES="1",
                      SLURM_NTASKS_PER_NODE=str(world), SLURM_RESTART_COUNT="1" if requeued else "0")
    steps = {}

    class Signal(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            steps.setdefault("first", trainer.global_step)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
            if not requeued and trainer.global_step == 1 and rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)

    model = make_model("gpt")
    trainer = L.Trainer(devices=world, strategy=MegaStrategy(tp=2, timeout=60), max_steps=6, callbacks=[Signal()],
                        default_root_dir=root, **trainer_kwargs())
    trainer.fit(model, TokenData(8, vocab_of(model), 4))
    return steps


def test_slurm_requeue_signal_saves_a_layout_free_checkpoint_on_every_rank_at_one_batch_and_the_requeued_run_resumes(
        tmp_path):
    """SIGUSR1 reaches rank 1 only: both ranks save Lightning's hpc checkpoint at the same batch (the signal held
    for one agreed all-reduce, not handled mid-collective); it is a lightning_tp directory, and the requeued
    run resumes from it with the losses of the run that went on."""
    import dist
    from lightning_tp.checkpoints.files import kind, read_meta

    first = dist.run(2, _slurm_fit, str(tmp_path), False, timeout=300)
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    assert kind(hpc) == "lightning_tp", sorted(p.name for p in tmp_path.iterdir())
    assert read_meta(hpc)["global_step"] == 2  # signalled after step 1: agreed at step 2's batch, saved at step 3's
    again = dist.run(2, _slurm_fit, str(tmp_path), True, timeout=300)
    assert [r["first"] for r in again] == [2, 2]
    for before, after in zip(first, again):
        assert sorted(k for k in after if k != "first") == [3, 4, 5, 6]
        assert max(abs(after[k] - before[k]) for k in (3, 4, 5, 6)) < 1e-5, (before, after)


def test_a_restart_at_another_dp_scales_accumulation_to_keep_the_global_batch_or_refuses():
    from types import SimpleNamespace

    from lightning_tp.faults.restarts import keep_global_batch

    for saved, acc, dp, want in ((2, 1, 1, 2), (4, 1, 2, 2), (1, 2, 2, 1), (2, 3, 2, 3)):
        trainer = SimpleNamespace(accumulate_grad_batches=acc)
        keep_global_batch(trainer, saved, dp)
        assert trainer.accumulate_grad_batches == want, (saved, acc, dp)
    with pytest.raises(ValueError, match=r"dp=2 with accumulate_grad_batches=1, a global batch of 2 .* dp=4"):
        keep_global_batch(SimpleNamespace(accumulate_grad_batches=1), 2, 4)


def _mid_epoch(rank, world, root):
    """tp=2 on 2 processes, 4 batches an epoch (shuffled by Lightning's DistributedSampler), a checkpoint every 3
    steps; then a second fit from the step-3 checkpoint, 1 step into an epoch... its losses by global step."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_tp import MegaStrategy
    from models import TokenData, make_model, trainer_kwargs, vocab_of

    def fit(ckpt_path=None, save=False):
        losses = {}

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])

        callbacks = [Record()] + ([ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1)] if save else [])
        model = make_model("gpt")
        trainer = L.Trainer(devices=world, strategy=MegaStrategy(tp=2, timeout=60), max_steps=10, callbacks=callbacks,
                            **trainer_kwargs(enable_checkpointing=save))
        trainer.fit(model, TokenData(16, vocab_of(model), 4), ckpt_path=ckpt_path)
        return losses

    whole = fit(save=True)
    return whole, fit(ckpt_path=os.path.join(root, "epoch=1-step=6.ckpt")), \
        fit(ckpt_path=os.path.join(root, "epoch=0-step=3.ckpt"))


def test_a_run_resumed_mid_epoch_trains_on_the_batches_that_follow_as_the_uninterrupted_run_did(tmp_path):
    """Checkpoints at steps 3 and 6 of 4-batch epochs (3 and 2 batches into an epoch): each resumed run's losses
    equal the uninterrupted run's from its step on (Lightning alone would replay the epoch from its start)."""
    import dist

    for whole, at6, at3 in dist.run(2, _mid_epoch, str(tmp_path), timeout=300):
        assert sorted(whole) == list(range(1, 11)) and sorted(at6) == list(range(7, 11)), (whole, at6)
        assert sorted(at3) == list(range(4, 11)), at3
        for resumed in (at6, at3):
            assert max(abs(loss - whole[step]) for step, loss in resumed.items()) < 1e-5, (whole, resumed)


def test_a_resumable_loader_skips_the_batches_trained_once_and_a_rebuilt_one_is_made_resumable_again():
    """Lightning rebuilds a loader passed to a second fit by its class: the rebuilt one gets its state too."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_tp.faults.resumable_data import ResumableDataLoader, resumable

    data = TensorDataset(torch.arange(10.0))
    loader = resumable(DataLoader(data, batch_size=2), lambda: (3, 1))
    rebuilt = resumable(ResumableDataLoader(data, batch_size=2), lambda: (3, 1))
    for made in (loader, rebuilt):
        assert made.state_dict() == {"lightning_tp_batches": 3, "replicas": 1}
        made.load_state_dict(made.state_dict())
        assert [b[0].tolist() for b in made] == [[6.0, 7.0], [8.0, 9.0]]  # once: the next epoch is whole
        assert len(list(made)) == 5
        made.load_state_dict({"lightning_tp_batches": 3, "replicas": 2})  # another dp: the epoch from its start
        assert len(list(made)) == 5
