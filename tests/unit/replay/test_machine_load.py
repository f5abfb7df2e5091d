"""What else the machine did while a run ran (replay/machine_load.py): a process outside kvbench
busy on a core is counted as others', kvbench's own children as ours; the figures, the report's
flag and compare's exit code follow."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from kvbench.cli import main
from kvbench.replay.local_servers import listening_pids
from kvbench.replay.machine_load import LOADED_SHARE, MachineLoadSampler, load_figures
from kvbench.replay.run_config import ServerBinding
from kvbench.server.lifecycle import free_port

DATA = Path(__file__).resolve().parents[2] / "data"
BUSY = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"


def _sample_while(seconds: float, sampler: MachineLoadSampler) -> dict:
    sampler.sample()
    time.sleep(seconds)
    record = sampler.sample()
    assert record is not None
    return record


def test_a_busy_process_outside_kvbench_counts_as_others_and_its_own_child_as_ours() -> None:
    """Shares at least a third of a core (the test may share the machine with other work)."""
    # not our child: started through a shell that exits at once, so it is re-parented away
    # (its output away from our pipe, or reading the pid would wait for it to end)
    outside = subprocess.Popen(["sh", "-c", f"{sys.executable} -c '{BUSY.format(s=3)}' >/dev/null 2>&1 & echo $!"],
                               stdout=subprocess.PIPE, text=True)
    outsider = int(outside.communicate()[0].strip())
    try:
        sampler = MachineLoadSampler()
        assert outsider not in {p.pid for p in sampler._our_processes()}
        record = _sample_while(1.5, sampler)
        assert record["others_share"] >= 0.3 / record["cores"]
    finally:
        subprocess.run(["kill", str(outsider)], check=False, capture_output=True)
    child = subprocess.Popen([sys.executable, "-c", BUSY.format(s=2)])
    try:
        sampler = MachineLoadSampler()
        assert child.pid in {p.pid for p in sampler._our_processes()}
        record = _sample_while(1.5, sampler)
        assert record["ours_share"] >= 0.3 / record["cores"]  # kvbench's child: ours, not a neighbour's
    finally:
        child.kill()
        child.wait()


def test_a_local_server_the_run_did_not_start_is_found_by_its_port_and_counts_as_ours() -> None:
    """`kvbench serve` in another shell, a benchmark's own instances: not the replay's children,
    found by the port their URL names, so their CPU is the run's own, not a neighbour's."""
    port = free_port()
    server = ("import socket, time\ns = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n"
              + BUSY.format(s=4)).format(port=port)
    outside = subprocess.Popen(["sh", "-c", f"{sys.executable} -c \"{server}\" >/dev/null 2>&1 & echo $!"],
                               stdout=subprocess.PIPE, text=True)
    outsider = int(outside.communicate()[0].strip())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while not listening_pids([url]) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = ServerBinding([url, "http://192.0.2.1:8000"]).found_pids()
        assert found == {url: outsider}  # (192.0.2.1: another machine, left out)
        assert ServerBinding([url], pids={url: outsider}).found_pids() == {}  # one kvbench started: known
        sampler = MachineLoadSampler(list(found.values()))
        record = _sample_while(1.5, sampler)
        assert record["ours_share"] >= 0.3 / record["cores"]
    finally:
        subprocess.run(["kill", str(outsider)], check=False, capture_output=True)


def test_load_figures_weigh_samples_by_time_and_flag_a_loaded_run() -> None:
    quiet = {"wall_s": 1.0, "others_share": 0.0, "steal_share": 0.0, "available_bytes": 8 << 30,
             "memory_pressure": 0.0}
    busy = {**quiet, "wall_s": 3.0, "others_share": 0.5, "available_bytes": 2 << 30, "memory_pressure": 0.25}
    figures = load_figures([quiet, busy])
    assert figures["others_cpu_share"] == 0.375 and figures["machine_loaded"] is True
    assert figures["min_available_memory_bytes"] == 2 << 30 and figures["max_memory_pressure"] == 0.25
    assert load_figures([quiet])["machine_loaded"] is False and load_figures([]) == {}
    assert LOADED_SHARE == 0.10


def test_a_loaded_run_is_flagged_in_the_report_and_compare_does_not_gate_on_it(tmp_path: Path) -> None:
    baseline, candidate = tmp_path / "baseline", tmp_path / "candidate"
    for copy in (baseline, candidate):
        shutil.copytree(DATA / "golden-runs", copy)
    summary_path = candidate / "fullshared" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary.update(others_cpu_share=0.42, p90_others_cpu_share=0.5, machine_loaded=True)
    summary_path.write_text(json.dumps(summary))
    result = CliRunner().invoke(main, ["compare", str(baseline), str(candidate), "--gate", "p50_ttft_ms=+50%"])
    assert result.exit_code == 3, result.output
    assert "loaded machine: fullshared" in result.output and "42% of the cores" in result.output
    allowed = CliRunner().invoke(main, ["compare", str(baseline), str(candidate), "--gate", "p50_ttft_ms=+50%",
                                        "--allow-loaded"])
    assert allowed.exit_code == 0, allowed.output
    assert CliRunner().invoke(main, ["compare", str(baseline), str(candidate)]).exit_code == 0  # no gate: a table
    failures = CliRunner().invoke(main, ["compare", str(baseline), str(candidate), "--gate", "failed=+0"])
    assert failures.exit_code == 0, failures.output  # a gate on failures is no timing: the load does not void it
    report = CliRunner().invoke(main, ["report", str(candidate), "-o", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output
    text = (tmp_path / "report" / "report.md").read_text()
    assert "**Loaded machine**" in text and "fullshared" in text.split("**Loaded machine**")[1].split("\n")[0]


def test_report_and_leaderboard_write_beside_their_runs_by_default(tmp_path: Path, monkeypatch) -> None:
    """Nothing lands in the working directory unless asked (it used to get reports/latest/ and leaderboard/)."""
    runs = tmp_path / "runs"
    shutil.copytree(DATA / "golden-runs", runs)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert CliRunner().invoke(main, ["report", str(runs)]).exit_code == 0
    assert CliRunner().invoke(main, ["leaderboard", str(runs)]).exit_code == 0
    assert (runs / "report" / "report.md").is_file() and (runs / "leaderboard").is_dir()
    assert list(elsewhere.iterdir()) == []
