import os
import sys

# Triton reads this once, at its first import (lightning imports triton): the kernel tests run the
# Triton kernels on CPU tensors in the interpreter. Dispatch elsewhere stays on the torch path.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread in the pytest processes too (their launches' ranks have one each): two workers whose
# references ran on every core spun OpenMP threads against the ranks of the other worker's launch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)


import pytest  # noqa: E402

# bench scripts run by bench/_smoke.py, with their arguments (--smoke unless given after ':')
SMOKE_ARGS = {"gpu_check.py": "--cpu-dry-run", "gpu_check_2gpu.py": "--cpu-dry-run"}


@pytest.fixture(scope="session")
def bench_smoke(tmp_path_factory):
    """Every bench/ script in its smoke mode, in one launch: {script: (exit code, seconds, output)}."""
    import subprocess
    from pathlib import Path

    bench = Path(ROOT) / "bench"
    scripts = sorted(p.name for p in bench.glob("*.py") if not p.name.startswith("_") and "__main__" in p.read_text())
    out = tmp_path_factory.mktemp("smoke")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    import signal

    proc = subprocess.Popen([sys.executable, str(bench / "_smoke.py"), str(out)] +
                            [f"{s}:{SMOKE_ARGS[s]}" if s in SMOKE_ARGS else s for s in scripts],
                            cwd=ROOT, env=env, start_new_session=True)
    try:
        assert proc.wait(timeout=600) == 0, "bench/_smoke.py failed"
    finally:  # its forked children and their workers too, were it stopped by the timeout
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    found = {}
    for s in scripts:
        rc, seconds = (out / f"{s}.rc").read_text().split() if (out / f"{s}.rc").exists() else ("-1", "0")
        log = (out / f"{s}.log").read_text() if (out / f"{s}.log").exists() else ""
        found[s] = (int(rc), float(seconds), log)
    return found


# The costliest files first (worker-seconds of a run, most first), so that two xdist workers taking a file
# at a time (make test: --dist loadfile --no-loadscope-reorder) end together: a long file started last
# would leave the other worker idle. The torchrun restarts lead: their waits overlap the other's work.
COSTLIEST = ("test_restart.py", "pipeline/test_pipeline.py", "test_hf.py", "test_planner.py", "test_resharding.py",
             "test_bench_smoke.py", "test_compile.py", "test_parity.py", "test_explain.py", "test_experts.py",
             "test_context.py", "test_checkpoint.py", "test_multinode.py", "test_zero3.py", "test_zero.py",
             "test_failures.py", "test_planner_memory.py", "test_selective.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(COSTLIEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))


def pytest_collection_finish(session):
    """What collection imported (torch, lightning, transformers) is never garbage: the collector leaves it alone."""
    import gc

    gc.freeze()


def pytest_unconfigure(config):
    """Hand the frozen objects back before the interpreter ends (else nanobind's Triton types report leaks)."""
    import gc

    gc.unfreeze()
