"""Every bench/ script in its smoke mode (a tiny model, one round, a few steps; the GPU checks' CPU dry run),
all in one launch (conftest's bench_smoke): each must exit 0 and print its table. Scripts are collected from
bench/ itself, so a new one runs here without being listed; nothing here looks at a timing."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from models import transformers_major

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# a line of each script's table (a regular expression): a new script fails below until it has one
TABLE = {
    "checkpoint_save.py": r"async/sync blocking: [\d.]+",
    "cp.py": r"step time at \d+ tokens against cp=1",
    "export_memory.py": r"plain\s+peak .* x largest tensor",
    "grouped_experts.py": r"\| 16 \| 4 \| 64 \| True \| [\d.]+ \| [\d.]+ \| [\d.]+ \|",
    "fused_kernels.py": r"needs a CUDA GPU|fused ms",  # on CPU it says so and measures nothing (the kernels: gpu_check)
    "moe.py": r"deepseek_v3\s+dp=2\s+ep=2[\s\S]*all-to-all bytes per step, both ranks: counted[\s\S]*gpt_balanced: .*busier rank / balanced share, summed over layers and timed steps: 1\.000",
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
# modules a script imports, with no __main__ of their own: script -> the script that runs them
HELPERS = {"gpu_check_train.py": "gpu_check.py", "gpu_check_cp.py": "gpu_check.py"}
# the GPU checks' dry runs (--cpu-dry-run), whose tables the tests at the end of this file read
ELSEWHERE = {"gpu_check.py", "gpu_check_2gpu.py"}
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in ELSEWHERE and s not in HELPERS])
def test_bench_script_runs_in_smoke_mode_and_prints_its_table(script, bench_smoke):
    assert script in TABLE, f"bench/{script}: add a --smoke mode and a line of its table to TABLE here"
    rc, _, out = bench_smoke[script]
    assert rc == 0, out[-6000:]
    assert re.search(TABLE[script], out), out[-4000:]


def test_helpers_are_imported_by_their_script_and_the_rest_run():
    for helper, script in HELPERS.items():
        assert "__main__" not in (BENCH / helper).read_text(), f"bench/{helper} runs by itself: give it a TABLE row"
        assert helper.removesuffix(".py") in (BENCH / script).read_text(), (helper, script)
    for script in ELSEWHERE:
        assert f'bench_smoke["{script}"]' in Path(__file__).read_text(), script


def test_the_smoke_set_runs_every_script_in_one_launch(bench_smoke):
    """Each script's wall time (not asserted: machines are noisy), for the durations report."""
    assert set(bench_smoke) == {s for s in SCRIPTS if s not in HELPERS}
    print({s: seconds for s, (_, seconds, _) in bench_smoke.items()})


def test_bench_does_not_import_tests():
    test_modules = {p.stem for p in (ROOT / "tests").glob("*.py")}
    for path in BENCH.glob("*.py"):
        text = path.read_text()
        imported = set(re.findall(r"^\s*(?:from|import)\s+(\w+)", text, flags=re.M))
        assert not imported & test_modules, f"bench/{path.name} imports {imported & test_modules} from tests/"
        assert '"tests"' not in text, f"bench/{path.name} puts tests/ on its path"


def test_no_bench_script_shadows_an_installed_package():
    """A script's folder is first on sys.path when it runs: bench/kernels.py hid the `kernels` package that
    transformers 5 imports, and every Hugging Face model failed to load in bench/."""
    import importlib.util
    import sys

    outside = [p for p in sys.path if Path(p or ".").resolve() not in (BENCH, ROOT / "tests")]
    for script in SCRIPTS:
        name = script.removesuffix(".py")
        found = importlib.machinery.PathFinder.find_spec(name, outside)
        assert found is None, f"bench/{script} has the name of {found.origin}: rename the script"


# ------------------------------------------------- bench/gpu_check.sh and gpu_check_2gpu.sh --cpu-dry-run
def test_the_wrappers_pass_their_arguments_to_the_python_they_choose(tmp_path):
    """gpu_check.sh and gpu_check_2gpu.sh with PYTHON set: they run that python on their script with the
    arguments given (the scripts themselves run in the bench_smoke launch below)."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\n[ "$1" = "-c" ] && exit 0\necho "ran $*"\n')
    fake.chmod(0o755)
    for wrapper in ("gpu_check.sh", "gpu_check_2gpu.sh"):
        proc = subprocess.run(["bash", str(ROOT / "bench" / wrapper), "--cpu-dry-run"], cwd=ROOT, capture_output=True,
                              env=dict(os.environ, PYTHON=str(fake)), text=True, timeout=60)
        script = wrapper.replace(".sh", ".py")
        assert proc.returncode == 0 and f"ran bench/{script} --cpu-dry-run" in proc.stdout, proc.stdout + proc.stderr


def test_gpu_check_cpu_dry_run_prints_one_table_and_passes(bench_smoke):
    rc, _, out = bench_smoke["gpu_check.py"]
    assert rc == 0, out[-6000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| check ")}
    for op in ("layer_norm", "rms_norm", "bias_gelu tanh", "bias_gelu exact", "rotary bhtd", "cross_entropy"):
        assert rows[f"kernel {op} fp32"] == rows[f"kernel {op} fp16"] == "PASS", op
        assert rows[f"kernel {op} bf16"] == rows[f"compiled {op} bf16"] == "SKIP", op
    for check in ("int8 GEMM correctness", "gpt step kernels=True", "gpt step quant=int8", "gpt int8 convert",
                  "trainer fit MegaStrategy(tp=1)", "trainer fit 16-mixed", "trainer fit bf16-mixed",
                  "trainer fit microbatches=2", "trainer fit checkpointing + dropout", "trainer fit quant=int8",
                  "checkpoint sync: resume + consolidate", "checkpoint async: resume + consolidate",
                  "compiled layer_norm fp32 [dry run]", "cp blocks fp32 flash_cpu", "cp ring fp32 (cp=4 threads)", "total"):
        assert rows[check] == "PASS", check
    assert rows["nccl init (1 process)"] == "SKIP" and "skipped: no GPU" in out
    # transformers 5's experts module behind the dispatch (4.x has none: said so)
    assert rows["hf 5.x experts (grouped_mm) dispatched"] == ("PASS" if transformers_major() >= 5 else "SKIP")
    assert sum(line.startswith("+-") for line in out.splitlines()) == 3  # one table: top, under the header, bottom


def test_gpu_check_2gpu_cpu_dry_run_passes_every_row(bench_smoke):
    """bench/gpu_check_2gpu.py --cpu-dry-run: 2 gloo processes, every collective and layout row PASS."""
    rc, _, out = bench_smoke["gpu_check_2gpu.py"]
    assert rc == 0, out[-6000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ")}
    assert len(rows) == 5 + 11 + 4 + 1, rows  # primitives, layouts (cp=2's two among them), zero=3 resumes, total
    assert set(rows.values()) == {"PASS"}, rows
