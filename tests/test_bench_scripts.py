"""Smoke runs of the overhead benchmarks and the GPU check (tiny grids, on the CPU): they
keep running as the code moves. They assert what the scripts print, never a timing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _run(script: str, *args: str) -> str:
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_bench_retrieval_prints_a_row_per_configuration_on_both_paths():
    # Host loops for bs=1 only: bs=2 takes the tensor path, so both are exercised.
    out = _run(
        "bench_retrieval.py", "--bs", "1", "2", "--context", "64", "--history", "0", "500",
        "--rounds", "3", "--warmup", "1", "--vocab", "1000", "--host-loop-max-batch", "1",
    )
    # propose, observe, append, total (medians), mean
    rows = re.findall(r"^\s*(\d+)\s+64\s+(\d+) \|\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+ \|", out, re.M)
    assert rows == [("1", "0"), ("2", "0"), ("1", "500"), ("2", "500")]
    assert "host loops up to bs=1" in out and "Python loop step" in out


def test_bench_retrieval_rejects_bad_sizes_by_name():
    for args, needle in ((["--rounds", "0"], "--rounds must be >= 1, got 0"), (["--bs", "1", "0"], "--bs values")):
        run = subprocess.run(
            [sys.executable, str(SCRIPTS / "bench_retrieval.py"), *args], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 2 and needle in run.stderr


def test_bench_core_prints_the_round_columns():
    out = _run("bench_core.py", "--batch-sizes", "1", "--budgets", "8", "--reps", "1", "--warmup", "0", "--threads", "1")
    assert "gates..pack" in out.splitlines()[-2]
    assert re.match(r"^\s*1\s+8(\s+\d+){5}\s+[\d.]+$", out.splitlines()[-1])


def test_gpu_check_runs_on_the_cpu_and_compares_retrieval_paths(tmp_path):
    out = _run(
        "gpu_check.py", "--device", "cpu", "--batch-sizes", "1", "--budgets", "16", "--reps", "1",
        "--out", str(tmp_path / "check.json"),
    )
    assert out.strip().endswith("gpu_check: passed")
    retrieval = json.loads((tmp_path / "check.json").read_text())["retrieval"]
    assert [row["bs"] for row in retrieval] == [1, 32]
    assert all(row["differing_rounds"] == 0 and row["stats_equal"] for row in retrieval)
