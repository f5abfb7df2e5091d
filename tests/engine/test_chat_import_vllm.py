"""An imported agent log (tests/data/chat-session.jsonl) replayed in vLLM under NonShared and
FullShared on the session's shared servers: every request completes, and FullShared reuses the
segments the import found in the middle of the writer's prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from paths import DATA

from kvbench.cli import main
from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine

SESSION = DATA / "chat-session.jsonl"


def test_an_imported_log_replays_under_nonshared_and_fullshared(vllm_server: VLLMServer, fullshared_server: VLLMServer,
                                                                tmp_path: Path) -> None:
    trace = tmp_path / "session.jsonl"
    assert CliRunner().invoke(main, ["trace", "import", str(SESSION), "-o", str(trace)]).exit_code == 0
    runs = {}
    for method, server in (("nonshared", vllm_server), ("fullshared", fullshared_server)):
        out = tmp_path / method
        result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--method", method, "--base-url",
                                           server.base_url, "--qps", "0", "--num-warmups", "0", "--result-dir", str(out)])
        assert result.exit_code == 0, result.output
        runs[method] = pd.read_parquet(out / "requests.parquet").set_index("turn_id")
        assert runs[method]["success"].all() and len(runs[method]) == 4
    writer = json.loads(runs["fullshared"].loc["writer.r0", "method_stats"])
    # the logs and the incident report from the investigator's cache, the findings from its output
    assert writer["reused_tokens"] > 500
    assert {s["source"].rsplit("/", 1)[-1] for s in writer["segments"]} == {"investigator.r0"}
