"""`kvbench sweep --ray`: a local Ray on this machine runs a sweep's cells (kvbench's stub servers,
started by the real command line in Ray's workers: tests/helpers/kvbench_stub_server.py) and leaves
the files a local sweep leaves; a killed worker's runs are retried; an interrupted driver resumes;
nothing of Ray or of the servers is left. The engine tier does one with real vLLM cells."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import psutil
import pytest
from paths import HELPERS, ROOT

from kvbench.experiment.file_bundle import BundleError, FileBundle, commit_folder, place_folder, sha256_bytes

# Only the tests that run Ray need it (the others check kvbench's side: resources, bundles, refusals)
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="the [ray] extra (scripts/install.sh installs it)")

HELPER = HELPERS / "kvbench_stub_server.py"
GRID = ["--methods", "nonshared,fullshared", "--shared-tokens", "64", "--qps", "0", "--num-trajectories", "2",
        "--output-len", "4"]
# What differs between two runs of the same cell anywhere: clocks, ids, ports, process ids.
VOLATILE_KEY = re.compile(r"(_ms|_ns|_s|_throughput|rss_bytes)$|^(date|run_id|request_id|base_urls|served_models|"
                          r"server_pids|server_info|server_command|server_url|segments|duration)$"
                          r"|cpu_share$|^(min_available_memory_bytes|max_memory_pressure|machine_load\w*)$")


def _sweep(out: Path, model: Path, *extra: str, token_delay: float = 0.0, wait: bool = True,
           fail_start: bool = False) -> subprocess.Popen[str] | subprocess.CompletedProcess[str]:
    env = {**os.environ, "STUB_TOKEN_DELAY": str(token_delay), "PYTHONPATH": str(HELPERS),
           "KVBENCH_RAY_WORKER_SETUP": "kvbench_stub_server.use_stub_servers", **({"STUB_FAIL_START": "1"} if fail_start else {})}
    command = [sys.executable, str(HELPER), "sweep", "-o", str(out), *GRID, "--model", str(model), *extra]
    if wait:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _ray_and_stub_processes() -> set[int]:
    found = set()
    for process in psutil.process_iter(["name", "cmdline", "status"]):
        command = " ".join(process.info["cmdline"] or [])
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if (process.info["name"] in ("raylet", "gcs_server") or command.startswith("ray::")
                or "ray/_private/workers" in command or "kvbench.replay.stub" in command):
            found.add(process.pid)
    return found


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _left_behind(before: set[int], timeout_s: float = 20.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _ray_and_stub_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _content(path: Path, root: Path) -> Any:
    """A result file's content with what differs between any two runs taken out, and the sweep
    folder's own path written as <sweep>."""
    if path.name == "machine_load.jsonl":
        return None  # what else the machine did: present, that is all
    text = path.read_text().replace(str(root), "<sweep>") if path.suffix in (".json", ".jsonl") else ""
    text = re.sub(r"http://127\.0\.0\.1:\d+", "<server>", text)  # each run's server has its own port
    if path.suffix == ".json":
        data: Any = json.loads(text)
    elif path.suffix == ".jsonl":
        data = [json.loads(line) for line in text.splitlines() if line]
    elif path.suffix == ".parquet":
        data = json.loads(pd.read_parquet(path).to_json(orient="records"))
    else:
        return None  # server logs (ports, times) and lock files: present, that is all

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not VOLATILE_KEY.search(k)}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(data)


def _files(root: Path) -> dict[str, Any]:
    return {p.relative_to(root).as_posix(): _content(p, root) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def local_sweep(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "sweep"
    result = _sweep(out, tiny_tokenizer_dir)
    assert result.returncode == 0, result.stderr
    return out


@needs_ray
def test_a_ray_sweep_leaves_a_local_sweeps_files_and_reruns_nothing(local_sweep: Path, tiny_tokenizer_dir: Path,
                                                                  tmp_path: Path) -> None:
    before = _ray_and_stub_processes()
    out = tmp_path / "sweep"
    result = _sweep(out, tiny_tokenizer_dir, "--ray", "--cell-cpus", "1")
    assert result.returncode == 0, result.stderr
    assert not _left_behind(before)
    for run in ("nonshared", "fullshared"):
        assert re.search(rf"\[ray\] {run} ctx64-a4-r1-qps0-rep0: started on \S+", result.stderr)
        assert re.search(rf"\[ray\] {run} ctx64-a4-r1-qps0-rep0: finished on \S+ in [\d.]+ s", result.stderr)
    local, ray = _files(local_sweep), _files(out)
    assert set(ray) - set(local) == {"ray_cells.jsonl"} and set(local) <= set(ray)
    for name, content in local.items():
        assert ray[name] == content, name
    config = json.loads((out / "runs/fullshared/ctx64-a4-r1-qps0-rep0/config.json").read_text())
    assert config["trace_path"] == str(out / "traces" / "ctx64-a4-r1.jsonl")  # the sweep's, not the worker's copy
    records = [json.loads(line) for line in (out / "ray_cells.jsonl").read_text().splitlines()]
    assert sorted(r["run"] for r in records) == ["runs/fullshared/ctx64-a4-r1-qps0-rep0",
                                                 "runs/nonshared/ctx64-a4-r1-qps0-rep0"]
    assert all(r["outcome"] == "finished" and r["task_start_s"] >= 0 and r["bytes"] > 0 for r in records)

    report = subprocess.run([sys.executable, "-m", "kvbench.cli", "report", str(out), "-o", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    table = (tmp_path / "report" / "report.md").read_text()
    assert "| fullshared" in table and "| nonshared" in table

    again = _sweep(out, tiny_tokenizer_dir, "--ray", "--cell-cpus", "1")
    assert again.returncode == 0, again.stderr
    assert "started on" not in again.stderr and again.stderr.count("done earlier") == 2
    assert len((out / "ray_cells.jsonl").read_text().splitlines()) == 2  # nothing ran again
    assert not _left_behind(before)


@needs_ray
def test_a_paper_protocol_sweep_ships_the_reference_to_the_later_tasks(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """--protocol paper on Ray: the task running the references (NonShared's) ends before any
    other starts, and the others replay every prompt on the references it made, recorded where
    the driver keeps them."""
    out = tmp_path / "sweep"
    result = _sweep(out, tiny_tokenizer_dir, "--protocol", "paper", "--ray", "--cell-cpus", "1")
    assert result.returncode == 0, result.stderr
    reference = out / "quality" / "ctx64-a4-r1" / "reference"
    assert result.stderr.index("quality/ctx64-a4-r1/reference: finished") < result.stderr.index("fullshared ctx64-a4-r1")
    ref = pd.read_parquet(reference / "requests.parquet")[["trajectory_id", "turn_id", "prompt_tokens"]]
    for method in ("nonshared", "fullshared"):
        cell = out / "runs" / method / "ctx64-a4-r1-qps0-rep0"
        config = json.loads((cell / "config.json").read_text())
        assert config["protocol"] == "paper" and config["reference_run"]["path"] == str(reference)
        requests = pd.read_parquet(cell / "requests.parquet").merge(ref, on=["trajectory_id", "turn_id"],
                                                                    suffixes=("", "_ref"))
        assert len(requests) == len(ref) and (requests["output_tokens"] == 1).all()
        assert (requests["prompt_tokens"] == requests["prompt_tokens_ref"]).all()


@needs_ray
def test_a_killed_workers_runs_are_retried(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    before = _ray_and_stub_processes()
    out = tmp_path / "sweep"
    process = _sweep(out, tiny_tokenizer_dir, "--ray", "--methods", "fullshared", token_delay=0.05, wait=False)
    assert isinstance(process, subprocess.Popen)
    deadline, stub = time.monotonic() + 120, None
    while stub is None:  # a cell's server is up: its parent is the Ray worker running the cell
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
        stub = next((psutil.Process(pid) for pid in _ray_and_stub_processes() - before
                     if "kvbench.replay.stub" in " ".join(psutil.Process(pid).cmdline())), None)
        time.sleep(0.1)
    group = os.getpgid(stub.pid)
    time.sleep(1.0)  # into the replay
    stub.parent().kill()  # type: ignore[union-attr]
    try:
        output, _ = process.communicate(timeout=240)
        deadline = time.monotonic() + 30
        while _running(stub) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # the stub's SIGTERM-proof child, left for this test's cleanup
    assert not _running(stub)  # the server went with its worker (parent-death signal)
    assert process.returncode == 0, output
    assert "task failed on" in output and "retrying its 1 unfinished run(s) (1 of 1)" in output
    records = [json.loads(line) for line in (out / "ray_cells.jsonl").read_text().splitlines()]
    assert [(r["outcome"], r["attempt"]) for r in records] == [("finished", 2)]
    assert json.loads((out / "runs/fullshared/ctx64-a4-r1-qps0-rep0/summary.json").read_text())["completed"] == 8
    assert not _left_behind(before)


@needs_ray
def test_runs_that_fail_on_every_attempt_are_recorded_and_rerun(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    failing = _sweep(out, tiny_tokenizer_dir, "--ray", "--methods", "fullshared", "--max-retries", "1",
                     fail_start=True)
    assert isinstance(failing, subprocess.CompletedProcess)
    assert failing.returncode == 1, failing.stderr
    assert "1 run(s) failed on every attempt: runs/fullshared/ctx64-a4-r1-qps0-rep0" in failing.stderr
    error = (out / "runs/fullshared/ctx64-a4-r1-qps0-rep0/error.txt").read_text()
    assert "each of 2 attempt(s)" in error and "exited with code 3 during start-up" in error
    # both attempts' server logs reached the driver
    assert (out / "runs/fullshared/server.log").read_text().count("stub: refusing to start") == 2
    rerun = _sweep(out, tiny_tokenizer_dir, "--ray", "--methods", "fullshared")
    assert rerun.returncode == 0, rerun.stderr  # the failed run is not done: the same command retries it
    assert "fullshared ctx64-a4-r1-qps0-rep0: finished on" in rerun.stderr


@needs_ray
def test_an_interrupted_driver_resumes(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    before = _ray_and_stub_processes()
    out = tmp_path / "sweep"
    process = _sweep(out, tiny_tokenizer_dir, "--ray", token_delay=0.05, wait=False)  # one cell at a time
    assert isinstance(process, subprocess.Popen)
    records = out / "ray_cells.jsonl"
    deadline = time.monotonic() + 180
    while not records.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, output
    assert not _left_behind(before)
    (finished,) = [json.loads(line)["run"] for line in records.read_text().splitlines()]
    resumed = _sweep(out, tiny_tokenizer_dir, "--ray")
    assert resumed.returncode == 0, resumed.stderr
    assert f"{finished.split('/', 1)[1].replace('/', ' ')}: done earlier" in resumed.stderr
    assert resumed.stderr.count("started on") == 1
    assert not _left_behind(before)


def test_ray_is_asked_for_what_a_cell_needs() -> None:
    from kvbench.experiment.ray_sweep import RayOptions, RaySweepError, cell_resources
    from kvbench.experiment.sweep import MethodConfig, SweepSpec

    cpu_nodes = [{"Alive": True, "Resources": {"CPU": 16.0, "memory": 64 * 2**30}},
                 {"Alive": True, "Resources": {"CPU": 8.0, "memory": 32 * 2**30}}]
    spec = SweepSpec(methods=[MethodConfig("nonshared")], cpu_kv_cache_gib=4.0, instances=2)
    assert cell_resources(spec, RayOptions(), cpu_nodes) == {"num_cpus": 8.0, "num_gpus": 0, "memory": 10 * 2**30}
    assert cell_resources(spec, RayOptions(cell_cpus=2, cell_memory_gib=0), cpu_nodes) == {"num_cpus": 2, "num_gpus": 0}
    gpu_nodes = [{"Alive": True, "Resources": {"CPU": 32.0, "GPU": 8.0, "memory": 256 * 2**30}}]
    tp2 = SweepSpec(methods=[MethodConfig("nonshared")], server_options={"extra_args": ["--tensor-parallel-size", "2"]})
    assert cell_resources(tp2, RayOptions(), gpu_nodes) == {"num_cpus": 1, "num_gpus": 2}
    with pytest.raises(RaySweepError, match="no node of the Ray cluster has 1 CPUs, 16 GPUs"):
        cell_resources(SweepSpec(methods=[MethodConfig("nonshared")], instances=8, server_options=tp2.server_options),
                       RayOptions(), gpu_nodes)


def test_bundles_are_checked_and_committed_whole(tmp_path: Path) -> None:
    source = tmp_path / "run"
    (source / "sub").mkdir(parents=True)
    (source / "summary.json").write_text("{}")
    (source / "sub" / "a.bin").write_bytes(b"\x00" * 10)
    bundle = FileBundle.of_folder(source)
    target = tmp_path / "sweep" / "runs" / "m" / "cell"
    target.mkdir(parents=True)
    (target / "stale.txt").write_text("an earlier, partial attempt")
    commit_folder(bundle, target)
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()) == ["sub/a.bin", "summary.json"]
    assert [p.name for p in target.parent.iterdir()] == ["cell"]  # no staging or replaced folder left
    damaged = FileBundle({**bundle.files, "summary.json": b"{\"x\": 1}"}, bundle.sha256)
    with pytest.raises(BundleError, match="summary.json: its bytes do not match"):
        commit_folder(damaged, target)
    with pytest.raises(BundleError, match="not a path inside"):
        FileBundle({"../x": b""}, {"../x": sha256_bytes(b"")}).verified()
    cache = tmp_path / "cache"
    placed = place_folder(bundle.sha256, bundle, cache, "the model")
    assert place_folder(bundle.sha256, None, cache, "the model") == placed  # kept for the node's next task
    with pytest.raises(BundleError, match="too large to send"):
        place_folder({"other": "0" * 64}, None, cache, "the model")


@needs_ray
def test_a_folder_is_used_in_place_or_placed_from_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from kvbench.experiment.file_bundle import folder_digests
    from kvbench.experiment.ray_inputs import FolderInput

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "weights.bin").write_bytes(b"\x01" * 100)
    bundle = FileBundle.of_folder(model)
    cache = tmp_path / "cache"
    here = FolderInput(str(model), bundle.sha256, content="object-ref")
    assert here.place(cache) == str(model)  # the driver's files at the driver's path: shared storage
    monkeypatch.setattr(ray, "get", lambda ref: bundle if ref == "object-ref" else None)
    placed = FolderInput(str(tmp_path / "not-on-this-node"), bundle.sha256, content="object-ref").place(cache)
    assert folder_digests(Path(placed)) == bundle.sha256 and Path(placed).parent == cache
    (model / "weights.bin").write_bytes(b"\x02" * 100)  # other files at that path on this node: not used
    assert here.place(cache) == placed
    with pytest.raises(BundleError, match="too large to send.*storage every node mounts"):
        FolderInput(str(tmp_path / "nowhere"), {"weights.bin": "0" * 64}, content=None).place(cache)


def test_a_worker_uses_its_own_embedded_model_only_with_the_drivers_weights() -> None:
    from kvbench.experiment.ray_inputs import ClusterInputs, place_inputs
    from kvbench.experiment.sweep import MethodConfig, SweepSpec
    from kvbench.model.resolve import resolve_model
    from kvbench.model.store import model_identity

    spec = SweepSpec(methods=[MethodConfig("nonshared")])
    driver_model = "/elsewhere/kvbench/model/weights/recall-v1"  # the driver's install, not this one

    def shipped(identity: str | None) -> ClusterInputs:
        return ClusterInputs(spec=spec, traces=FileBundle({}, {}), trace_paths={}, model=driver_model,
                             model_identity=identity, tokenizer_name="kvbench:recall-v1", model_folder=None)

    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        inputs = place_inputs(shipped(model_identity(resolve_model(None))), Path(scratch))
        assert inputs.served_model == resolve_model(None) and inputs.model == driver_model  # loads its own, records the driver's
        assert inputs.tokenizer.name == "kvbench:recall-v1"
        with pytest.raises(BundleError, match="install the same kvbench on every node"):
            place_inputs(shipped("kvbench:recall-v1@0000"), Path(scratch))


def test_fidelity_tables_and_the_max_qps_search_are_refused_on_ray(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    from click.testing import CliRunner

    from kvbench.cli import main

    fidelity = CliRunner().invoke(main, ["paper", "fig2", "--run", "--ray", "-o", str(tmp_path / "f")])
    assert fidelity.exit_code == 2 and "run it without --ray" in fidelity.output
    search = CliRunner().invoke(main, ["sweep", "-o", str(tmp_path / "s"), "--ray", "--find-max-qps", "--goodput",
                                       "ttft:100", "--model", str(tiny_tokenizer_dir), "--shared-tokens", "64",
                                       "--output-len", "4"])
    assert search.exit_code == 2 and "not with --ray" in search.output
    stray = CliRunner().invoke(main, ["sweep", "-o", str(tmp_path / "t"), "--cell-cpus", "1", "--model",
                                      str(tiny_tokenizer_dir), "--shared-tokens", "64", "--output-len", "4"])
    assert stray.exit_code == 2 and "--cell-cpus only apply with --ray" in stray.output
