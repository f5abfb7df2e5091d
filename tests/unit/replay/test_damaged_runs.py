"""A full disk loses nothing and damaged run folders are read from what survives: the requests
journal is the source of truth, `summarize` rebuilds requests.parquet from it (and says so), a
resume appends without rewriting, and every failure is one line naming the folder."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench import run_files
from kvbench.cli import main
from kvbench.replay.stub import StubServer

REPLAY = ["--qps", "0", "--shared-tokens", "64", "--output-len", "64", "--save-prompt-ids"]


def _replay(stub: StubServer, out: Path, trajectories: int, *extra: str,
            file_limit: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit_files() -> None:  # stands in for a full disk where no small file system can be mounted
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))  # type: ignore[arg-type]

    return subprocess.run([sys.executable, "-m", "kvbench", "replay", "--base-url", stub.base_url, *REPLAY,
                           "--num-trajectories", str(trajectories), "--result-dir", str(out), *extra],
                          capture_output=True, text=True, timeout=300, preexec_fn=limit_files if file_limit else None)


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    with StubServer() as server:
        yield server


@pytest.fixture(scope="module")
def recorded(stub: StubServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    done = _replay(stub, out, 5)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def run(recorded: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(recorded, copy)
    (copy / run_files.SUMMARY).unlink()
    return copy


def _summarize(path: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["summarize", str(path)])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def _records(path: Path) -> int:
    return len(run_files.read_requests_journal(path / run_files.REQUESTS_JOURNAL))


@pytest.mark.parametrize("damage, said", [
    ("missing", "requests.parquet: missing; rebuilt from the journal"),
    ("garbage", "requests.parquet: unreadable"),
    ("shorter", "requests.parquet: held 3 of the journal's 20 records; rebuilt"),
    ("directory", "requests.parquet: not a file; not rewritten"),
])
def test_summarize_reads_the_journal_when_the_parquet_is_damaged(run: Path, damage: str, said: str) -> None:
    parquet = run / run_files.REQUESTS
    journal = run_files.read_requests_journal(run / run_files.REQUESTS_JOURNAL)
    assert len(journal) == 20
    parquet.unlink()
    if damage == "garbage":
        parquet.write_bytes(b"PAR1 this is not parquet")
    elif damage == "shorter":
        run_files.write_requests_parquet(journal[:3], parquet)
    elif damage == "directory":
        parquet.mkdir()
    code, output = _summarize(run)
    assert code == 0, output
    assert said in output and "20 completed" in output
    summary = json.loads((run / run_files.SUMMARY).read_text())
    assert summary["num_prompts"] == 20 and summary["completed"] == 20
    if damage != "directory":
        assert run_files.load_requests(run, rebuild=False).source == run_files.REQUESTS  # rebuilt whole
        assert _summarize(run)[1].count("note:") == 0


def test_a_good_summary_is_never_replaced_by_an_empty_one(run: Path) -> None:
    assert _summarize(run)[0] == 0
    good = (run / run_files.SUMMARY).read_text()
    (run / run_files.REQUESTS_JOURNAL).write_text("")
    run_files.write_requests_parquet([], run / run_files.REQUESTS)
    code, output = _summarize(run)
    assert code == 1 and "kept that summary" in output
    assert (run / run_files.SUMMARY).read_text() == good


@pytest.mark.parametrize("content, said", [
    ("[1, 2]", "holds a JSON list, not the object"),
    ("{not json", "is not JSON"),
])
def test_a_damaged_config_is_one_line(run: Path, content: str, said: str) -> None:
    (run / run_files.CONFIG).write_text(content)
    code, output = _summarize(run)
    assert code == 1 and said in output and len(output.strip().splitlines()) == 1


@pytest.mark.parametrize("summary, said", [
    ([1, 2], "holds a JSON list"),
    ({"method": "x", "p50_ttft_ms": "fast", "completed": 3}, "p50_ttft_ms: expected a number, got str 'fast'"),
    ({"method": "x", "config": [1]}, "config: expected a dict, got list"),
])
def test_report_names_a_damaged_summary(run: Path, tmp_path: Path, summary: object, said: str) -> None:
    (run / run_files.SUMMARY).write_text(json.dumps(summary))
    result = CliRunner().invoke(main, ["report", str(run), "-o", str(tmp_path / "report")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert said in result.output


def test_report_reads_a_run_whose_parquet_is_a_directory(run: Path, tmp_path: Path) -> None:
    assert _summarize(run)[0] == 0
    (run / run_files.REQUESTS).unlink()
    (run / run_files.REQUESTS).mkdir()
    result = CliRunner().invoke(main, ["report", str(run), "-o", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output


def _small_disk(tmp_path: Path) -> Path | None:
    """A 2 MiB tmpfs (root only), or None where none can be mounted."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return None
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    return mount if done.returncode == 0 else None


def test_a_full_disk_ends_the_run_in_one_line_and_loses_nothing(stub: StubServer, tmp_path: Path) -> None:
    disk = _small_disk(tmp_path)
    out = (disk or tmp_path) / "run"
    try:
        stopped = _replay(stub, out, 200, file_limit=None if disk else 2 << 20)
        assert stopped.returncode == 1
        assert "Traceback" not in stopped.stderr, stopped.stderr
        error = [line for line in stopped.stderr.splitlines() if line.startswith("Error:")]
        assert len(error) == 1 and f"cannot write to {out}" in error[0] and "are safe in requests.jsonl" in error[0]
        assert not list(out.glob("*.tmp")), "a failed write leaves no temporary file"
        journaled = _records(out)
        assert 0 < journaled < 800
        if disk is not None:
            subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)  # space freed
        code, output = _summarize(out)  # (a file-size limit was the replay's process's alone)
        assert code == 0, output
        assert f"{journaled} completed" in output  # every journaled request, none lost
        resumed = _replay(stub, out, 200, "--resume")  # appends only: no rewrite of the journal
        assert resumed.returncode == 0, resumed.stderr
        summary = json.loads((out / run_files.SUMMARY).read_text())
        assert summary["completed"] == 800 and summary["requests_source"] == run_files.REQUESTS
    finally:
        if disk is not None:
            subprocess.run(["umount", str(disk)], check=False)
