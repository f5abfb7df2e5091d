"""The benchmark scripts run (here on the CPU, at tiny shapes) and print consistent figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_correction_timing.py"


def test_correction_timing_script_runs_on_cpu() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "64,128", "--layers", "2",
                             "--kv-heads", "2", "--head-dim", "16", "--rank", "8", "--anchors", "3", "--repeats", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("device=cpu copy bandwidth")
    rows = [line for line in lines if line.startswith("n=")]
    assert [line.split(":")[0] for line in rows] == ["n=64", "n=128"]
    steps = [line.split(":")[0].strip() for line in lines if line.startswith("  ")]
    assert steps == ["gate", "delta", "rotate"] * 2
    assert all("of copy bandwidth" in line for line in lines if line.startswith("  "))
    for row in rows:  # the total is the sum of its parts, as printed
        total, parts = row.split("correction ")[1].split(" ms = ")
        numbers = [float(part.split()[-1]) for part in parts.split(" (")[0].split(" + ")]
        assert abs(float(total) - sum(numbers)) < 0.02 + 1e-3 * float(total)


def test_delta_transfer_script_reports_bounds(default_model: str) -> None:
    """The oracle fits use the target itself, so they can never do worse than the estimates they
    generalize (best_segment spans mean_others and the zero correction; best_token spans those)."""
    script = SCRIPT.parent / "delta_transfer.py"
    result = subprocess.run([sys.executable, str(script), "--model", default_model, "--shared-tokens", "96",
                             "--contents", "3", "--rank", "4", "--dtype", "float32"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    values = {line.split()[0]: float(line.split()[1]) for line in result.stdout.splitlines()[1:]}
    assert set(values) == {"fullshared", "mean_others", "anchors_r4", "best_segment", "best_token",
                           "delta_cosine_k", "delta_cosine_v"}
    assert 0 < values["fullshared"] < 1
    assert values["best_segment"] <= min(values["mean_others"], values["fullshared"]) + 1e-6
    assert values["best_token"] <= values["best_segment"] + 1e-6
    assert -1 <= values["delta_cosine_k"] <= 1 and -1 <= values["delta_cosine_v"] <= 1


def test_self_attention_script_prints_both_timings_and_their_ratio() -> None:
    script = SCRIPT.parent / "bench_self_attention.py"
    result = subprocess.run([sys.executable, str(script), "--tokens", "64,200", "--repeats", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("n=")]
    assert [row.split(":")[0] for row in rows] == ["n=64", "n=200"]
    for row in rows:  # the ratio is the two printed timings' ratio
        match = re.fullmatch(r"n=\d+: sdpa ([\d.]+) ms, kernel ([\d.]+) ms, sdpa/kernel ([\d.]+)x", row)
        assert match, row
        sdpa, kernel, ratio = (float(x) for x in match.groups())
        assert sdpa > 0 and kernel > 0
        assert abs(ratio - sdpa / kernel) < 0.01 + 0.02 * ratio  # the timings print to 1 us
