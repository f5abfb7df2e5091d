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


def test_load_waits_counts_the_steps_other_loads_ran_while_a_first_agent_waited(tmp_path: Path) -> None:
    import json

    import pandas as pd

    def request(turn: str, created: float, load_s: float, offsets: list[float], recomputed: int) -> dict:
        stats = {"load_s": load_s, "load_step_offsets_s": offsets}
        return {"turn_id": turn, "first_token_ns": int((created + load_s) * 1e9), "ttft_ms": load_s * 1e3,
                "prompt_tokens": 1000, "recomputed_tokens": recomputed, "method_stats": json.dumps(stats)}

    pd.DataFrame([
        request("A0.r0", 10.0, 1.2, [0.0, 0.3, 0.6, 0.9], 1000),  # steps at 10.0, 10.3, 10.6, 10.9
        request("A0.r0", 10.1, 2.2, [1.0, 1.3, 1.6, 1.9], 1000),  # waits [10.1, 11.1): three of those steps
        request("A1.r0", 10.5, 0.3, [0.2], 100),  # a short reuse load, one step at 10.7, inside that wait
        request("A2.r0", 12.0, 0.3, [0.0], 900),  # a dense reuse load after every wait
    ]).to_parquet(tmp_path / "requests.parquet")
    script = SCRIPT.parent / "load_waits.py"
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "first agents 2," in out and "sum 1.0 s" in out and "gaps between layers 0.30-0.30 s" in out, out
    assert "{'A0': 2, 'reuse': 1, 'reuse-dense': 1}" in out, out
    assert "steps other loads ran while a first agent waited: {'A0': 3, 'reuse': 1}" in out, out
