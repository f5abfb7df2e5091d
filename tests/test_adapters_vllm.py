"""Agents as LoRA adapters on real vLLM (CPU): the adapters load, change what an agent writes, and
the connector's methods run beside them."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.model.adapters import build_random_adapter
from kvbench.replay.server import VLLMServer, method_server_config

pytestmark = pytest.mark.engine


def _trace(tmp_path: Path, name: str, *adapters: str) -> Path:
    out = tmp_path / f"{name}.jsonl"
    result = CliRunner().invoke(main, ["gen-trace", "-o", str(out), "--task", "recall", "--shared-tokens", "256",
                                       "--num-trajectories", "3", "--qps", "0", "--seed", "3",
                                       *[a for spec in adapters for a in ("--adapter", spec)]])
    assert result.exit_code == 0, result.output
    return out


def _replay(trace: Path, url: str, out: Path, method: str = "nonshared") -> pd.DataFrame:
    result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--base-url", url, "--qps", "0", "--method", method,
                                       "--num-warmups", "0", "--result-dir", str(out)])
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(out / "requests.parquet")
    assert requests["success"].all()
    return requests.set_index(["trajectory_id", "turn_id"])


def test_adapters_load_change_outputs_and_run_beside_the_connector(default_model: str, tmp_path: Path) -> None:
    random = build_random_adapter(default_model, tmp_path / "reader-random", seed=1)
    zero = build_random_adapter(default_model, tmp_path / "reader-zero", zero=True)
    modules = {"reader-random": str(random), "reader-zero": str(zero)}
    plain = _trace(tmp_path, "plain")
    with_random = _trace(tmp_path, "random", f"Table Reader={random}")
    with_zero = _trace(tmp_path, "zero", f"Table Reader={zero}")
    # One FullShared server (the connector beside LoRA): first agents reuse nothing, so they are
    # computed as under NonShared (issue 36), and later agents reuse the adapter agent's cache as
    # it is (the naive writer-change baseline)
    with VLLMServer(method_server_config("fullshared", default_model, lora_modules=modules, max_model_len=2048,
                                         log_path=tmp_path / "fullshared.log")) as server:
        base = _replay(plain, server.base_url, tmp_path / "base", "fullshared")
        changed = _replay(with_random, server.base_url, tmp_path / "random", "fullshared")
        same = _replay(with_zero, server.base_url, tmp_path / "zero", "fullshared")
    first = [(t, "A0.r0") for t in base.index.get_level_values(0).unique()]
    outputs = {name: [list(frame.loc[key, "output_token_ids"]) for key in first]
               for name, frame in (("base", base), ("random", changed), ("zero", same))}
    assert outputs["zero"] == outputs["base"]  # the identity adapter is the base model
    assert outputs["random"] != outputs["base"]  # a real adapter changes what its agent writes
    assert (changed["reused_tokens"] > 0).any()  # later agents reused the adapter agent's cache
