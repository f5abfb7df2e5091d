"""`kvbench check` on a real vLLM server (CPU, the embedded model): FullShared's invariants pass on
the session's server. The other methods' invariants run in their own modules, on the servers
those already start (test_delta_methods_vllm, test_cacheblend_vllm, which also plants a broken
method and sees it fail, test_droidspeak_vllm, test_polykv_vllm, test_adapters_vllm,
test_precache_vllm).

A source read at the wrong offset cannot be planted from the client: the connector reuses only
rows whose tokens match at the source's offset (kvbench.methods.connector.materialize), so a
misplaced read falls back to computing them, and the outputs stay right."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_helpers import all_passed, method_check

from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine


def test_fullshared_passes_its_invariants(fullshared_server: VLLMServer, tmp_path: Path) -> None:
    report = method_check(tmp_path, "fullshared", fullshared_server)
    assert all_passed(report), report["outcomes"]
    assert [o["invariant"] for o in report["outcomes"]] == ["self-read", "rope-realignment"]
    assert report["model_identity"].startswith("kvbench:recall-v1@") and report["git_sha"]
