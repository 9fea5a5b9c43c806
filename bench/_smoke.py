"""Bench scripts in their smoke mode, each its own ``__main__`` in a child forked from this process (which
imported torch, lightning and transformers once), two at a time: ``python bench/_smoke.py OUT a.py
b.py:--cpu-dry-run`` (args after ':', else --smoke) writes OUT/<script>.log and OUT/<script>.rc."""

import gc
import os
import sys
import time
import traceback
import types
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")  # read once, at triton's import: the kernels run on CPU tensors
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

import lightning  # noqa: E402,F401  (imported once, here, for every child)
import torch  # noqa: E402,F401

import lightning_tp  # noqa: E402,F401

try:
    import transformers  # noqa: F401
except ImportError:  # pragma: no cover
    pass


def _run_as_main(script: Path, args: list, log: Path) -> None:
    """In the forked child: the script as __main__ with args, its output to log; never returns."""
    gc.freeze()  # the imports made once here are never garbage: the collector leaves them alone
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [str(script)] + args
    sys.path[0] = str(script.parent)
    os.environ["LIGHTNING_TP_LOCAL_START"] = "fork"  # this process runs nothing else: its workers fork from it
    # zb_recompute.py re-execs itself to have glibc read this at start; here it only stops that (smoke figures)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    sys.modules["__main__"] = main
    rc = 0
    try:
        exec(compile(script.read_text(), str(script), "exec"), main.__dict__)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported in the log
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main(out: Path, scripts: list, parallel: int = 2) -> None:
    out.mkdir(parents=True, exist_ok=True)
    waiting, running = list(scripts), {}
    while waiting or running:
        while waiting and len(running) < parallel:
            name, _, args = waiting.pop(0).partition(":")
            pid = os.fork()
            if pid == 0:
                _run_as_main(BENCH / name, args.split() if args else ["--smoke"], out / f"{name}.log")
            running[pid] = (name, time.monotonic())
        pid, status = os.wait()
        name, t0 = running.pop(pid)
        (out / f"{name}.rc").write_text(f"{os.waitstatus_to_exitcode(status)} {time.monotonic() - t0:.1f}\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
