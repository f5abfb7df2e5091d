"""The GPU timing script of the correction path runs (here on the CPU, at tiny shapes)."""

from __future__ import annotations

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
    assert [line.split(":")[0] for line in lines[1:]] == ["n=64", "n=128"]
    assert all("GB/s" in line and "fractions of copy bandwidth" in line for line in lines[1:])
