"""bench/gpu_check.sh --cpu-dry-run: the GPU check's plumbing (wrapper, every check function, the
table, the exit status) on CPU, with the kernels in the Triton interpreter and tiny sizes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import transformers_major

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_dry_run_prints_one_table_and_passes():
    env = dict(os.environ, PYTHON=sys.executable)  # the wrapper then makes no venv
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu-dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| check ")}
    for op in ("layer_norm", "rms_norm", "softmax causal+pad", "bias_gelu tanh", "bias_gelu exact",
               "bias_dropout_add p=0.1", "rotary bhtd", "cross_entropy"):
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


def test_gpu_check_2gpu_cpu_dry_run_passes_every_row():
    """bench/gpu_check_2gpu.sh --cpu-dry-run: 2 gloo processes, every collective and layout row PASS."""
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check_2gpu.sh"), "--cpu-dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in proc.stdout.splitlines()
            if line.startswith("| ")}
    assert len(rows) == 5 + 11 + 4 + 1, rows  # primitives, layouts (cp=2's two among them), zero=3 resumes, total
    assert set(rows.values()) == {"PASS"}, rows
