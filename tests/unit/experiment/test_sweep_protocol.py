"""`kvbench sweep --protocol paper` (the paper's Appendix B.4) against kvbench's stub servers: the
reference run goes first, once per trace, on the NonShared server; every cell then replays on its
outputs, each request stopping at its first token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
from paths import HELPERS, ROOT

GRID = ["--methods", "nonshared,fullshared", "--shared-tokens", "64", "--qps", "0,4", "--num-trajectories", "2",
        "--output-len", "4", "--num-warmups", "0"]


def _sweep(out: Path, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STUB_TOKEN_DELAY": "0", "PYTHONPATH": str(HELPERS)}
    return subprocess.run([sys.executable, str(HELPERS / "kvbench_stub_server.py"), "sweep", "-o", str(out), *GRID,
                           "--model", str(model), *extra], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_a_paper_protocol_sweep_replays_every_cell_on_the_reference(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    done = _sweep(tmp_path / "s", tiny_tokenizer_dir, "--protocol", "paper")
    assert done.returncode == 0, done.stderr
    reference = tmp_path / "s" / "quality" / "ctx64-a4-r1" / "reference"
    assert json.loads((reference / "config.json").read_text())["protocol"] == "free"
    assert not (reference.parent / "floor").exists()  # the floor is --quality's, not the protocol's
    ref = pd.read_parquet(reference / "requests.parquet")
    assert (ref["output_tokens"] == 4).all()
    cells = sorted((tmp_path / "s" / "runs").glob("*/ctx64-*"))
    assert len(cells) == 4
    for cell in cells:
        config = json.loads((cell / "config.json").read_text())
        assert config["protocol"] == "paper" and config["reference_run"]["path"] == str(reference)
        requests = pd.read_parquet(cell / "requests.parquet")
        assert len(requests) == len(ref) and (requests["output_tokens"] == 1).all()
        # the prompts carry the reference's outputs: each turn's prompt is as long as the reference's
        merged = requests.merge(ref, on=["trajectory_id", "turn_id"], suffixes=("", "_ref"))
        assert (merged["prompt_tokens"] == merged["prompt_tokens_ref"]).all()
    refused = _sweep(tmp_path / "r", tiny_tokenizer_dir, "--protocol", "paper", "--ray")
    assert refused.returncode == 2 and "without --ray" in refused.stderr
