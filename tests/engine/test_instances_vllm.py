"""Two vLLM instances sharing caches through Mooncake Store (issue 53), as `kvbench serve --instances 2`
runs them: under agent routing every reader runs on the other instance than its source and reads it
from the shared tier; its outputs are trajectory routing's on the same instances (each trajectory
on one instance: what one instance on those cores gives), token for token; and nothing is left
running after SIGINT.

(Against one instance on all of the machine's cores the outputs can differ in a rare greedy flip:
vLLM's CPU backend computes alike only at the same thread count, which routing does not change.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import psutil
import pytest
from click.testing import CliRunner

from kvbench.analysis.metrics import method_stats_of
from kvbench.cli import main

pytestmark = pytest.mark.engine


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
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


@contextlib.contextmanager
def _two_instances(method: str, model: str, log_dir: Path) -> Iterator[dict]:
    """`kvbench serve --method METHOD --instances 2` up (what it printed: URLs, pids, the master);
    stopped with SIGINT after, and checked to leave nothing running."""
    serve = subprocess.Popen([sys.executable, "-m", "kvbench", "serve", "--method", method, "--model", model,
                              "--instances", "2", "--max-model-len", "4096", "--log", str(log_dir)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    started: dict = {}
    try:
        assert serve.stdout is not None
        started.update(json.loads(serve.stdout.readline() or "{}"))
        assert len(started.get("base_urls", [])) == 2, f"kvbench serve --instances 2 did not start: {started}"
        yield started
    finally:
        serve.send_signal(signal.SIGINT)
        code = serve.wait(timeout=120)
    assert code == 0 and all(_gone(pid) for pid in started["pids"].values())  # the instances and the master


def test_a_source_on_one_instance_is_read_on_the_other(default_model: str, tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store", reason="the [mooncake] extra (scripts/install.sh installs it)")
    trace = tmp_path / "trace.jsonl"
    made = CliRunner().invoke(main, ["gen-trace", "-o", str(trace), "--model", default_model, "--qps", "0",
                                     "--num-trajectories", "3", "--shared-tokens", "256", "--output-len", "8"])
    assert made.exit_code == 0, made.output
    runs = {}
    with _two_instances("fullshared", default_model, tmp_path / "servers") as started:
        urls = [arg for url in started["base_urls"] for arg in ("--base-url", url)]
        for routing in ("agent", "trajectory"):
            runs[routing] = tmp_path / routing
            result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--method", "fullshared", "--qps", "0",
                                               "--routing", routing, *urls, "--result-dir", str(runs[routing])])
            assert result.exit_code == 0, result.output
    assert started["shared_tier"]["master_pid"] in started["pids"].values()
    assert _outputs(runs["agent"]) == _outputs(runs["trajectory"])
    agent, trajectory = (json.loads((runs[r] / "summary.json").read_text()) for r in ("agent", "trajectory"))
    assert agent["shared_remote_hits"] > 0 and agent["shared_misses"] == 0 and agent["shared_rejected"] == 0
    assert trajectory["shared_remote_hits"] == 0 and trajectory["shared_puts"] == agent["shared_puts"] > 0
    assert agent["reused_tokens"] == trajectory["reused_tokens"] > 0 and agent["p50_shared_get_ms"] > 0
    assert agent["config"]["shared_tier_readable"] is True
    requests = pd.read_parquet(runs["agent"] / "requests.parquet")
    assert set(requests["server_url"]) == set(started["base_urls"])  # each request records its instance


def test_kvcmas_anchors_observed_on_one_instance_serve_the_other(default_model: str, tmp_path: Path) -> None:
    """Issue 68: under agent routing each instance sees only its agents' turns; with the anchor
    pools shared through the tier (the default), the anchors one instance observed join the
    other's pool, so its turns decide with both instances' anchors. `anchor_sharing=instance`
    (set on the running servers) keeps each pool to its own turns, for comparison."""
    pytest.importorskip("mooncake.store", reason="the [mooncake] extra (scripts/install.sh installs it)")
    from kvbench.server.worker_rpc import WorkerClient

    trace = tmp_path / "trace.jsonl"
    made = CliRunner().invoke(main, ["gen-trace", "-o", str(trace), "--model", default_model, "--qps", "0",
                                     "--num-trajectories", "6", "--shared-tokens", "512", "--output-len", "8"])
    assert made.exit_code == 0, made.output
    summaries = {}
    with _two_instances("kvcmas", default_model, tmp_path / "servers") as started:
        urls = [arg for url in started["base_urls"] for arg in ("--base-url", url)]
        for sharing in ("tier", "instance"):
            for url in started["base_urls"]:
                WorkerClient(url).set_params({"anchor_sharing": sharing})
            result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--method", "kvcmas", "--qps", "0",
                                               "--routing", "agent", "--num-warmups", "3", "--prime-method-state",
                                               *urls, "--result-dir", str(tmp_path / sharing)])
            assert result.exit_code == 0, result.output
            summaries[sharing] = json.loads((tmp_path / sharing / "summary.json").read_text())
            if sharing == "tier":  # a run after it starts from nothing it left in the tier: the first
                # trajectory after the reset decides every segment with no anchor (each edge's first)
                result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--method", "kvcmas", "--qps",
                                                   "0", "--routing", "agent", "--num-trajectories", "1", *urls,
                                                   "--result-dir", str(tmp_path / "after")])
                assert result.exit_code == 0, result.output
                stats = method_stats_of(pd.read_parquet(tmp_path / "after" / "requests.parquet"))
                after = [d for made in stats for d in made.get("decisions", [])]
                assert after and all(d["anchors"] == 0 for d in after), after
    shared, alone = summaries["tier"], summaries["instance"]
    assert shared["shared_anchors_imported"] > 0 and shared["shared_anchors_rejected"] == 0
    assert shared["shared_anchor_put_bytes"] > 0 and shared["shared_anchor_remote_bytes"] > 0
    assert alone.get("shared_anchors_imported", 0) == 0
    # both instances' anchors: no decision goes dense for want of them that per-instance pools would take
    assert (shared["cold_start_dense_share"] or 0) <= (alone["cold_start_dense_share"] or 0)
    assert shared["realized_rho"] >= alone["realized_rho"]
