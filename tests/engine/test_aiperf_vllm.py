"""AIPerf (its own environment, .venv-aiperf, which scripts/install.sh makes) replays kvbench's
DAG JSONL export against a vLLM server and completes every request (docs/interop.md)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from paths import ROOT

from kvbench.cli import main
from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine

AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"


@pytest.mark.skipif(bool(os.environ.get("KVBENCH_SKIP_AIPERF")), reason="KVBENCH_SKIP_AIPERF is set")
def test_aiperf_replays_the_dag_export_and_completes_every_request(vllm_server: VLLMServer, default_model: str,
                                                                   tmp_path: Path) -> None:
    # scripts/install.sh installs it unless told not to: a missing one is a failed install, not a skip
    assert AIPERF.exists(), f"AIPerf is not installed at {AIPERF}: run scripts/install.sh (or set KVBENCH_SKIP_AIPERF=1)"
    trace, dag = tmp_path / "trace.jsonl", tmp_path / "dag.jsonl"
    for args in (["gen-trace", "-o", str(trace), "--shared-tokens", "128", "--num-trajectories", "2", "--qps", "0",
                  "--output-len", "8"],
                 ["trace", "export", str(trace), "--format", "aiperf", "-o", str(dag)]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    turns = 8  # two trajectories of four agents
    run = subprocess.run([str(AIPERF), "profile", "--model", default_model, "--url", vllm_server.base_url,
                          "--endpoint-type", "chat", "--streaming", "--input-file", str(dag),
                          "--custom-dataset-type", "dag_jsonl",
                          "--tokenizer", default_model, "--request-count", str(turns), "--output-artifact-dir",
                          str(tmp_path / "aiperf"), "--ui-type", "none"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "aiperf" / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == turns and not summary["error_summary"]
    # docs/interop.md's recipe streams: AIPerf measures time to first token only then
    assert summary["time_to_first_token"]["avg"] > 0
