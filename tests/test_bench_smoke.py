"""Every bench/ script in its smoke mode (a tiny model, one round, a few steps): it must exit 0 and print
its table. The scripts are collected from bench/ itself, so a new one runs here without being listed;
nothing here looks at a timing."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# a line of each script's table (a regular expression): a new script fails below until it has one
TABLE = {
    "checkpoint_save.py": r"async/sync blocking: [\d.]+",
    "cp.py": r"step time at \d+ tokens against cp=1",
    "export_memory.py": r"plain\s+peak .* x largest tensor",
    "kernels.py": r"needs a CUDA GPU|fused ms",  # on CPU it says so and measures nothing (the kernels: gpu_check)
    "moe.py": r"all-to-all bytes per step, both ranks: counted",
    "overhead.py": r"overhead ratio \(mega / single\)",
    "pipeline.py": r"1\) Our executor: measured step time",
    "plan_cpu.py": r"largest deviation .* rank correlation",
    "plan_megatron.py": r"largest deviation from the published per-GPU throughput",
    "qat.py": r"w4a8 QAT int8",
    "recompute.py": r"selective\s+[\d.]+ MiB",
    "timeline.py": r"measured/replayed",
    "zb_recompute.py": r"zb checkpoint\s+[\d.]+ ms",
    "zero.py": r"against zero=0:\n\s+dp=2 gpt\s+zero=1 step time",
}
# run in their smoke mode by another test: script -> that test (bench/gpu_check.sh --cpu-dry-run)
ELSEWHERE = {"gpu_check.py": "test_gpu_check.py", "gpu_check.sh": "test_gpu_check.py",
             "gpu_check_train.py": "test_gpu_check.py",  # gpu_check.sh's Trainer rows
             "gpu_check_cp.py": "test_gpu_check.py",  # gpu_check.sh's context-parallel rows
             "gpu_check_2gpu.py": "test_gpu_check.py", "gpu_check_2gpu.sh": "test_gpu_check.py"}
SCRIPTS = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("_"))


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in ELSEWHERE])
def test_bench_script_runs_in_smoke_mode_and_prints_its_table(script):
    assert script in TABLE, f"bench/{script}: add a --smoke mode and a line of its table to TABLE here"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH / script), "--smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert re.search(TABLE[script], proc.stdout), proc.stdout[-4000:]


def test_scripts_run_elsewhere_are_run_there():
    for script, test in ELSEWHERE.items():
        assert (BENCH / script).exists(), f"ELSEWHERE names bench/{script}, which is gone"
        assert "gpu_check.sh" in (ROOT / "tests" / test).read_text(), (script, test)


def test_bench_does_not_import_tests():
    test_modules = {p.stem for p in (ROOT / "tests").glob("*.py")}
    for path in BENCH.glob("*.py"):
        text = path.read_text()
        imported = set(re.findall(r"^\s*(?:from|import)\s+(\w+)", text, flags=re.M))
        assert not imported & test_modules, f"bench/{path.name} imports {imported & test_modules} from tests/"
        assert '"tests"' not in text, f"bench/{path.name} puts tests/ on its path"
