"""A rank killed mid-run under ``torchrun --max-restarts 1``: the job restarts by itself, resumes from the
newest complete checkpoint without a ckpt_path (MegaStrategy(resume="auto")), and ends with the losses
and weights of an uninterrupted run. A fresh run next to old checkpoints starts from scratch."""

import json
import os
import subprocess
import sys
import time

import torch

from dist import stop_agents as _stop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "restart_job.py")
KILL_AT, STEPS, TIMEOUT = 5, 8, 300


def _job(out, kill_at: int):
    """torchrun --max-restarts 1 of the job on 4 local processes; returns its exit code and log."""
    out.mkdir(exist_ok=True)
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "4",
               "--max-restarts", "1", JOB]
    env = {**os.environ, "RESTART_OUT": str(out), "RESTART_KILL_AT": str(kill_at), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(ROOT, "tests"), ROOT, os.environ.get("PYTHONPATH")]))}
    with open(out / "log.txt", "w+") as log:
        agent = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = agent.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop([agent])
        log.seek(0)
        return code, log.read()[-8000:]


def _records(out, attempt):
    return [json.loads((out / f"attempt{attempt}_rank{r}.json").read_text()) for r in range(4)]


def test_a_killed_rank_restarts_the_job_which_resumes_and_ends_as_an_uninterrupted_run(tmp_path):
    code, log = _job(tmp_path / "whole", 0)
    assert code == 0, log
    whole = _records(tmp_path / "whole", 0)
    code, log = _job(tmp_path / "killed", KILL_AT)
    assert code == 0, log
    first, second = _records(tmp_path / "killed", 0), _records(tmp_path / "killed", 1)
    assert "resuming from" in log and "step=4" in log, log  # the checkpoint of epoch 2, the newest complete one
    reference = {int(k): v for k, v in whole[0]["losses"].items()}
    assert sorted(reference) == list(range(1, STEPS + 1))
    for r in range(4):
        before = {int(k): v for k, v in first[r]["losses"].items()}
        after = {int(k): v for k, v in second[r]["losses"].items()}
        assert max(before) <= KILL_AT and sorted(after) == list(range(5, STEPS + 1)), (before, after)
        for step, loss in {**before, **after}.items():
            assert abs(loss - reference[step]) < 1e-5, (r, step, loss, reference[step])
    got, ref = torch.load(tmp_path / "killed" / "weights.pt"), torch.load(tmp_path / "whole" / "weights.pt")
    assert set(got) == set(ref)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
    killed = next(rec["killed"] for rec in first if "killed" in rec)
    print(f"from the kill to training again: {min(rec['started'] for rec in second) - killed:.1f} s")


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
