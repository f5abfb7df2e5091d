"""`kvbench sweep --protocol paper` (the paper's Appendix B.4) against kvbench's stub servers: the
reference run goes first, once per trace, on the NonShared server; every cell then replays on its
outputs, each request stopping at its first token."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
from paths import HELPERS, ROOT

from kvbench.tracegen.trace_files import read_trace

GRID = ["--methods", "nonshared,fullshared", "--shared-tokens", "64", "--qps", "0,4", "--num-trajectories", "2",
        "--output-len", "4", "--num-warmups", "0"]


def _sweep(out: Path, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STUB_TOKEN_DELAY": "0", "PYTHONPATH": str(HELPERS)}
    return subprocess.run([sys.executable, str(HELPERS / "kvbench_stub_server.py"), "sweep", "-o", str(out), *GRID,
                           "--model", str(model), *extra], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_a_paper_protocol_sweep_replays_every_cell_on_the_reference(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    done = _sweep(tmp_path / "s", tiny_tokenizer_dir, "--protocol", "paper", "--save-prompt-ids")
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
        # the prompts carry the reference's outputs: each turn's prompt is the reference's, token for token
        merged = requests.merge(ref, on=["trajectory_id", "turn_id"], suffixes=("", "_ref"))
        assert [list(p) for p in merged["prompt_token_ids"]] == [list(p) for p in merged["prompt_token_ids_ref"]]
        later = merged[merged["turn_id"] != "A0.r0"]
        assert len(later) and all(len(p) > len(q) for p, q in zip(later["prompt_token_ids"],
                                                                   merged.loc[later.index - 1, "prompt_token_ids"]))


def test_target_rho_calibrates_each_gated_configuration_once_per_trace(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """`sweep --target-rho 0.5,0.9`: one configuration per target for a gated method (kvcmas), the
    ungated ones once; each calibrated on its server on trajectories the cells do not replay, the
    threshold recorded and run by every cell; a rerun reads the calibration back."""
    extra = ["--methods", "nonshared,kvcmas", "--qps", "0", "--target-rho", "0.5,0.9"]
    done = _sweep(tmp_path / "s", tiny_tokenizer_dir, *extra)
    assert done.returncode == 0, done.stderr
    configs = sorted(p.name for p in (tmp_path / "s" / "runs").iterdir())
    assert configs == ["kvcmas-rho0.5", "kvcmas-rho0.9", "nonshared"]
    for target in (0.5, 0.9):
        report = json.loads((tmp_path / "s" / "calibration" / f"kvcmas-rho{target:g}-ctx64-a4-r1.json").read_text())
        assert report["target_rho"] == target and report["steps"] and report["seed"] == 1000
        # replayed as a cell is: the cells' trajectory count and warm-ups, a pool they leave cold
        cells_trace = read_trace(tmp_path / "s" / "traces" / "ctx64-a4-r1.jsonl")
        assert report["trajectories"] == len(cells_trace.trajectories) and report["prime_method_state"] is False
        (cell,) = (tmp_path / "s" / "runs" / f"kvcmas-rho{target:g}").glob("ctx64-*")
        config = json.loads((cell / "config.json").read_text())
        assert config["target_rho"] == target and config["method_params"]["tau"] == report["tau"]
        assert config["method_config"] == f"kvcmas-rho{target:g}"
    nonshared = json.loads(next((tmp_path / "s" / "runs" / "nonshared").glob("ctx64-*/config.json")).read_text())
    assert nonshared["target_rho"] is None
    calibration = tmp_path / "s" / "calibration" / "kvcmas-rho0.5-ctx64-a4-r1.json"
    shutil.rmtree(next((tmp_path / "s" / "runs" / "kvcmas-rho0.5").glob("ctx64-*")))  # a cell to run again
    before = calibration.stat().st_mtime_ns
    assert _sweep(tmp_path / "s", tiny_tokenizer_dir, *extra).returncode == 0
    assert calibration.stat().st_mtime_ns == before  # read back, not calibrated again
    assert len(list((tmp_path / "s" / "runs" / "kvcmas-rho0.5").glob("ctx64-*"))) == 1
    refused = _sweep(tmp_path / "r", tiny_tokenizer_dir, *extra, "--method-param", "kvcmas:tau=0.3")
    assert refused.returncode == 2 and "what --target-rho calibrates" in refused.stderr
