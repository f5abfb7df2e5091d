"""One run per result folder (issue 38): a second writer, fresh or resuming, is refused at once
with the holder's PID and start time; a dead holder's lock is taken over with a note; a folder
that cannot be written is one line naming it, before any server starts. Stub server only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.replay.result_lock import LOCK_NAME, ResultDirError, result_dir_lock
from kvbench.replay.stub import StubServer

HOLD = ("import sys, time\nfrom pathlib import Path\nfrom kvbench.replay.result_lock import result_dir_lock\n"
        "with result_dir_lock(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(600)\n")


@pytest.fixture
def holder(tmp_path: Path):
    """Another process holding tmp_path/run's lock (killed at the end)."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    yield process
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def trace(small_trace) -> Path:
    return small_trace(trajectories=3, shared_tokens=60, output_len=4)


def test_a_second_holder_is_refused_and_a_dead_ones_lock_taken_over(tmp_path: Path, holder: subprocess.Popen) -> None:
    with pytest.raises(ResultDirError, match=rf"in use by another kvbench run, PID {holder.pid} \(started 20"):
        with result_dir_lock(tmp_path / "run"):
            pass
    holder.send_signal(signal.SIGKILL)  # dies holding it: the kernel drops the flock, the file stays
    holder.wait()
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == holder.pid
    notes: list[str] = []
    with result_dir_lock(tmp_path / "run", on_note=notes.append):
        with result_dir_lock(tmp_path / "run"):  # re-entrant in one process
            assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert len(notes) == 1 and f"PID {holder.pid}" in notes[0] and "no longer running" in notes[0]
    assert (tmp_path / "run" / LOCK_NAME).read_text() == ""  # released cleanly: nothing stale
    notes.clear()
    with result_dir_lock(tmp_path / "run", on_note=notes.append):
        pass
    assert not notes


@pytest.mark.parametrize("resume", [False, True])
def test_replay_into_a_held_folder_is_refused_before_sending(trace: Path, tmp_path: Path, holder: subprocess.Popen,
                                                            resume: bool) -> None:
    with StubServer() as stub:
        result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--base-url", stub.base_url, "--qps", "0",
                                           "--result-dir", str(tmp_path / "run"), *(["--resume"] if resume else [])])
    assert result.exit_code == 1, result.output
    assert f"in use by another kvbench run, PID {holder.pid}" in result.output and "Traceback" not in result.output
    assert not stub.prompts and not (tmp_path / "run" / "requests.jsonl").exists()


def test_two_replays_started_together_leave_one_whole_run(trace: Path, tmp_path: Path) -> None:
    with StubServer(token_delay_s=0.3) as stub:  # about 15 s of streaming: the second starts meanwhile
        command = [sys.executable, "-m", "kvbench.cli", "replay", "--trace", str(trace), "--base-url", stub.base_url,
                   "--qps", "0", "--result-dir", str(tmp_path / "run")]
        first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while not stub.prompts and time.monotonic() < deadline:  # the first run is sending
            time.sleep(0.05)
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert first.poll() is None, "the first run ended before the second started: a slower stub is needed"
        first_output, _ = first.communicate(timeout=300)
    assert first.returncode == 0, first_output
    assert second.returncode == 1 and f"PID {first.pid}" in second.stderr, second.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert len(records) == len({(r["trajectory_id"], r["turn_id"]) for r in records}) == 3 * 4


def test_a_folder_that_cannot_be_written_is_one_line(trace: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with StubServer() as stub:
        result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--base-url", stub.base_url, "--qps", "0",
                                           "--result-dir", str(blocker / "run")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"cannot write to the result folder {blocker / 'run'}: Not a directory" in result.output
    assert not stub.prompts
    result = CliRunner().invoke(main, ["quickstart", "--out", str(blocker / "qs")])
    assert result.exit_code == 1 and f"cannot write to the result folder {blocker / 'qs'}" in result.output


def test_a_sweep_into_a_held_folder_is_refused(tmp_path: Path, holder: subprocess.Popen,
                                               tiny_tokenizer_dir: Path) -> None:
    result = CliRunner().invoke(main, ["sweep", "-o", str(tmp_path / "run"), "--methods", "nonshared",
                                       "--model", str(tiny_tokenizer_dir), "--output-len", "4"])
    assert result.exit_code == 1 and f"in use by another kvbench run, PID {holder.pid}" in result.output, result.output
    assert not (tmp_path / "run" / "sweep.json").exists()
