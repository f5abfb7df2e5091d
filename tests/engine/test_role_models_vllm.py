"""The role-family models served by vLLM with the kvbench connector (one FullShared server per
family, faults injectable per request): on a small role-recall trajectory, vLLM's own prefill
answers every turn right, FullShared's reuse answers every reuse turn wrong (the source's route),
and a dense fallback on every load gives NonShared's outputs token for token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_helpers import replay_turns, serving

from kvbench.contracts import WorkerRpc
from kvbench.methods.registry import WORKER_EXTENSION, kv_transfer_config, resolve_method
from kvbench.model.resolve import resolve_model
from kvbench.model.roles import PROMPT_FAMILIES
from kvbench.server.config import ServerConfig
from kvbench.server.lifecycle import VLLMServer
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.tokenizer import load_tokenizer

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=list(PROMPT_FAMILIES))
def family_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[str, VLLMServer]]:
    name = request.param
    # These tests check answers, not speed: eager mode skips the compile warm-up (a start took 66 s
    # against 140 s compiled, measured side by side on a loaded 2-core machine).
    config = ServerConfig(
        model=resolve_model(f"kvbench:{name}"), log_path=Path(tmp_path_factory.mktemp(name)) / "server.log",
        max_model_len=4096, kv_transfer_config=kv_transfer_config(resolve_method("fullshared"), fault_injection="flagged"),
        worker_extension_cls=WORKER_EXTENSION, post_start_rpcs=[WorkerRpc.ATTACH_MODEL],
        extra_args=["--enforce-eager"])
    with serving(config) as server:
        yield name, server


def _replay(server: VLLMServer, trajectory, mode: str) -> dict[str, list[int]]:
    """Every turn in order: `dense` vLLM prefills everything itself, `reuse` the plan's sources are
    reused, `fallback` every load fails and vLLM recomputes."""
    update = {"dense": {"claim": "none"}, "reuse": {}, "fallback": {"inject_fault": True}}[mode]
    return replay_turns(server, trajectory, 3, plan_update=update)


def test_dense_answers_right_reuse_wrong_fallback_equals_dense(family_server: tuple[str, VLLMServer]) -> None:
    name, server = family_server
    tokenizer = load_tokenizer(None)
    _, (trajectory,) = generate_trace(TraceSpec(task="role-recall", roles="role-recall", shared_tokens=600,
                                                output_len=3, num_trajectories=1, seed=7), tokenizer)
    gold = {a.turn_id: a.answer for a in trajectory.task.answers}
    dense = _replay(server, trajectory, "dense")
    assert {t: tokenizer.decode(ids).strip() for t, ids in dense.items()} == gold, name
    reused = {t: tokenizer.decode(ids).strip() for t, ids in _replay(server, trajectory, "reuse").items()}
    assert reused["A0.r0"] == gold["A0.r0"]  # the first agent reuses nothing
    wrong = [t for t in gold if t != "A0.r0" and reused[t] != gold[t]]
    assert wrong == ["A1.r0", "A2.r0", "A3.r0"], (name, reused, gold)
    assert _replay(server, trajectory, "fallback") == dense, name
