"""`kvbench sweep --ray` with real vLLM cells: a local Ray runs NonShared's and FullShared's cells
(one vLLM server each, in Ray's workers) on the embedded model; the sweep folder holds both, as a
local sweep's would, `kvbench report` reads it, a rerun runs nothing, and no Ray or vLLM process
is left. (The stub-server tests in tests/unit/experiment/test_ray_sweep.py cover retries,
interruptions and file-by-file equality with a local sweep.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.engine
pytest.importorskip("ray", reason="the [ray] extra (scripts/install.sh installs it)")

COMMAND = ["--ray", "--methods", "nonshared,fullshared", "--shared-tokens", "1024", "--qps", "0",
           "--num-trajectories", "2", "--output-len", "16"]


def _ray_or_vllm() -> set[int]:
    found = set()
    for process in psutil.process_iter(["name", "cmdline", "status"]):
        command = " ".join(process.info["cmdline"] or [])
        if process.info["status"] != psutil.STATUS_ZOMBIE and (
                process.info["name"] in ("raylet", "gcs_server") or command.startswith("ray::")
                or "ray/_private/workers" in command or "vllm.entrypoints" in command or "EngineCore" in command):
            found.add(process.pid)
    return found


def test_a_ray_sweep_of_two_vllm_cells(tmp_path: Path) -> None:
    before = _ray_or_vllm()
    out = tmp_path / "sweep"
    run = subprocess.run([sys.executable, "-m", "kvbench.cli", "sweep", "-o", str(out), *COMMAND],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    for method in ("nonshared", "fullshared"):
        summary = json.loads((out / "runs" / method / "ctx1024-a4-r1-qps0-rep0" / "summary.json").read_text())
        assert summary["completed"] == 8 and summary["failed"] == 0, method
        assert f"{method} ctx1024-a4-r1-qps0-rep0: finished on" in run.stderr
        assert (out / "runs" / method / "server.log").stat().st_size > 0  # the worker's vLLM log, at the driver
    fullshared = json.loads((out / "runs/fullshared/ctx1024-a4-r1-qps0-rep0/summary.json").read_text())
    assert fullshared["realized_rho"] > 0.5  # the connector ran inside the worker's vLLM and reused caches

    report = subprocess.run([sys.executable, "-m", "kvbench.cli", "report", str(out), "-o", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    table = (tmp_path / "report" / "report.md").read_text()
    assert "| fullshared" in table and "| nonshared" in table

    again = subprocess.run([sys.executable, "-m", "kvbench.cli", "sweep", "-o", str(out), *COMMAND],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stderr.count("done earlier") == 2 and "started on" not in again.stderr
    deadline = time.monotonic() + 30
    while (left := _ray_or_vllm() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [psutil.Process(pid).cmdline() for pid in left if psutil.pid_exists(pid)]
