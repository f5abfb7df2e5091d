"""Two vLLM instances sharing caches through Mooncake Store (issue 53): under agent routing every
reader runs on the other instance than its source, reads it from the shared tier, and gives the
one-instance run's outputs token for token; nothing is left running after the run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine


def _gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def _outputs(run: Path) -> dict[tuple[str, str], list[int]]:
    requests = pd.read_parquet(run / "requests.parquet")
    assert requests["success"].all()
    return {(r.trajectory_id, r.turn_id): list(r.output_token_ids) for r in requests.itertuples()}


def test_a_source_on_one_instance_is_read_on_the_other(fullshared_server: VLLMServer, default_model: str,
                                                       tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store", reason="the [mooncake] extra (scripts/install.sh installs it)")
    trace = tmp_path / "trace.jsonl"
    made = CliRunner().invoke(main, ["gen-trace", "-o", str(trace), "--model", default_model, "--qps", "0",
                                     "--num-trajectories", "3", "--shared-tokens", "256", "--output-len", "8"])
    assert made.exit_code == 0, made.output
    replay = ["replay", "--trace", str(trace), "--method", "fullshared", "--qps", "0"]
    one = CliRunner().invoke(main, [*replay, "--base-url", fullshared_server.base_url, "--result-dir", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    two = CliRunner().invoke(main, [*replay, "--instances", "2", "--routing", "agent", "--max-model-len", "4096",
                                    "--result-dir", str(tmp_path / "two")])
    assert two.exit_code == 0, two.output
    assert _outputs(tmp_path / "two") == _outputs(tmp_path / "one")
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["shared_remote_hits"] > 0 and summary["shared_misses"] == 0 and summary["shared_rejected"] == 0
    assert summary["reused_tokens"] == json.loads((tmp_path / "one" / "summary.json").read_text())["reused_tokens"] > 0
    assert summary["p50_shared_get_ms"] > 0 and summary["shared_store_peak_bytes"] > 0
    config = summary["config"]
    assert config["instances"] == 2 and len(set(config["base_urls"])) == 2 and config["shared_tier_readable"]
    requests = pd.read_parquet(tmp_path / "two" / "requests.parquet")
    assert set(requests["server_url"]) == set(config["base_urls"])  # each request records its instance
    pids = [*config["server_pids"].values()]
    assert config["shared_tier"]["master_pid"] in pids and all(_gone(pid) for pid in pids)
