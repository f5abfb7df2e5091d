"""docs/ci.md's regression job, its steps run against stand-in servers (no engine): the baseline
is made, an unchanged method passes, a method whose outputs changed fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from paths import ROOT

from kvbench.replay.stub import StubServer


def _run(tmp_path: Path, reference: StubServer, method: StubServer, model: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVBENCH": f"{sys.executable} -m kvbench", "KVBENCH_METHOD": "fullshared",
           "KVBENCH_BASELINE": str(tmp_path / "baseline"), "KVBENCH_OUT": str(tmp_path / "candidate"),
           "KVBENCH_REFERENCE_URL": reference.base_url, "KVBENCH_METHOD_URL": method.base_url,
           "KVBENCH_TRACE_ARGS": f"--qps 0 --num-trajectories 3 --shared-tokens 64 --output-len 4 --model {model}",
           "KVBENCH_REPLAY_ARGS": "--qps 0",
           # The quality gates only: a stand-in server's TTFTs are noise, not a method's speed.
           "KVBENCH_GATES": "--gate exact_match_rate=-0.1 --gate mean_token_f1=-0.05"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "ci_regression.sh")], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)


def test_the_ci_job_makes_a_baseline_passes_and_fails_on_a_quality_regression(tiny_tokenizer_dir: Path,
                                                                               tmp_path: Path) -> None:
    with StubServer() as reference, StubServer(connector=True, connector_method="fullshared") as method:
        made = _run(tmp_path, reference, method, tiny_tokenizer_dir)
        assert made.returncode == 0, made.stderr
        assert "baseline made" in made.stdout and (tmp_path / "baseline" / "reference" / "summary.json").exists()
        same = _run(tmp_path, reference, method, tiny_tokenizer_dir)
        assert same.returncode == 0, same.stdout + same.stderr
        assert "all gates passed" in (tmp_path / "candidate" / "comparison.md").read_text()
        method.output_shift = 7  # the method now changes what the model says
        worse = _run(tmp_path, reference, method, tiny_tokenizer_dir)
    assert worse.returncode == 1, worse.stdout + worse.stderr
    comparison = (tmp_path / "candidate" / "comparison.md").read_text()
    assert "REGRESSION" in comparison and "exact_match_rate" in comparison
