"""Agents as LoRA adapters on real vLLM (CPU): the adapters load, change what an agent writes, a
connector method runs beside them (PReCache's ReBaseShared, which rebuilds each reader's values),
and with identity adapters ReBaseShared gives vLLM's own outputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from vllm_helpers import all_passed, method_check, replay_turns, serving

from kvbench.cli import main
from kvbench.experiment.check_requests import ADAPTER_PREFIX
from kvbench.methods.registry import resolve_method
from kvbench.model.adapters import build_random_adapter
from kvbench.server.config import method_server_config
from kvbench.server.lifecycle import VLLMServer
from kvbench.tracegen.trace_files import read_trace

pytestmark = pytest.mark.engine
AGENTS = 4


@pytest.fixture(scope="module")
def adapters(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    folders = {"reader-random": build_random_adapter(default_model, root / "reader-random", seed=1),
               "reader-zero": build_random_adapter(default_model, root / "reader-zero", zero=True),
               **{f"zero-{i}": build_random_adapter(default_model, root / f"zero-{i}", zero=True)
                  for i in range(AGENTS)},
               **{f"{ADAPTER_PREFIX}{i}": build_random_adapter(default_model, root / f"check-{i}", zero=True)
                  for i in range(2)}}
    return {name: str(path) for name, path in folders.items()}


@pytest.fixture(scope="module")
def rebase_server(default_model: str, adapters: dict[str, str], tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[VLLMServer]:
    log = Path(tmp_path_factory.mktemp("rebase")) / "server.log"
    with serving(method_server_config(resolve_method("precache-rebase"), default_model, lora_modules=adapters, max_model_len=2048,
                                      log_path=log)) as server:
        yield server


def _trace(tmp_path: Path, name: str, *adapters: str) -> Path:
    out = tmp_path / f"{name}.jsonl"
    result = CliRunner().invoke(main, ["gen-trace", "-o", str(out), "--task", "recall", "--shared-tokens", "256",
                                       "--num-trajectories", "3", "--qps", "0", "--seed", "3",
                                       *[a for spec in adapters for a in ("--adapter", spec)]])
    assert result.exit_code == 0, result.output
    return out


def _replay(trace: Path, url: str, out: Path, method: str) -> pd.DataFrame:
    result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--base-url", url, "--qps", "0", "--method", method,
                                       "--num-warmups", "0", "--result-dir", str(out)])
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(out / "requests.parquet")
    assert requests["success"].all()
    return requests.set_index(["trajectory_id", "turn_id"])


def test_adapters_load_change_outputs_and_run_beside_the_connector(rebase_server: VLLMServer, adapters: dict[str, str],
                                                                   tmp_path: Path) -> None:
    with_random = _trace(tmp_path, "random", f"Table Reader={adapters['reader-random']}")
    with_zero = _trace(tmp_path, "zero", f"Table Reader={adapters['reader-zero']}")
    # First agents reuse nothing, so they are computed by vLLM itself (issue 36); later agents
    # reuse the adapter agent's cache with their own values rebuilt
    url = rebase_server.base_url
    changed = _replay(with_random, url, tmp_path / "random", "precache-rebase")
    same = _replay(with_zero, url, tmp_path / "zero", "precache-rebase")
    trajectories = read_trace(with_zero).trajectories
    first = [(t.trajectory_id, "A0.r0") for t in trajectories]
    # the base model's outputs (no adapter), from vLLM's own prefill of the same prompts
    base = {(t.trajectory_id, "A0.r0"): replay_turns(rebase_server, t, t.turns[0].max_tokens, dict.fromkeys(t.agents),
                                                     plan_update={"claim": "none"})["A0.r0"] for t in trajectories}
    outputs = {"base": [base[key] for key in first],
               **{name: [list(frame.loc[key, "output_token_ids"]) for key in first]
                  for name, frame in (("random", changed), ("zero", same))}}
    assert outputs["zero"] == outputs["base"]  # the identity adapter is the base model
    assert outputs["random"] != outputs["base"]  # a real adapter changes what its agent writes
    assert (changed["reused_tokens"] > 0).any()  # later agents reused the adapter agent's cache


def test_rebase_with_identity_adapters_gives_the_base_models_outputs(rebase_server: VLLMServer, tmp_path: Path) -> None:
    """`kvbench check`: one system prompt for every agent (the table's rows see the same context in
    every prompt, so their adapter-free rows are what each agent's own prefill computes), one
    identity adapter per agent (no exact copies), the table reused: the base model's outputs."""
    assert all_passed(method_check(tmp_path, "precache-rebase", rebase_server))
