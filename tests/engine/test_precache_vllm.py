"""PReCache's methods inside vLLM (CPU) with LoRA adapters served, on kvbench:roles-adapter (a
constructed test model whose roles are in their V-only route adapters): both rebuild each reader's
values and answer every reuse turn along the reader's route, where reusing the writer's cache as
it is answers the writer's (tests/unit/model/test_role_adapters.py). Identity adapters on the embedded model:
tests/engine/test_adapters_vllm.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_helpers import all_passed, all_request_stats, method_check, replay_turns, serving

from kvbench.contracts import WorkerRpc
from kvbench.experiment.check_requests import ADAPTER_PREFIX
from kvbench.methods.registry import WORKER_EXTENSION, kv_transfer_config, resolve_method
from kvbench.model.adapters import build_random_adapter
from kvbench.model.resolve import resolve_model
from kvbench.model.role_adapters import build_route_adapter
from kvbench.server.config import ServerConfig
from kvbench.server.lifecycle import VLLMServer
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.tasks.role_recall import reading_of
from kvbench.tracegen.tokenizer import load_tokenizer

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=["precache-prelr", "precache-rebase"])
def route_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[str, VLLMServer]]:
    root = Path(tmp_path_factory.mktemp(request.param))
    model = resolve_model("kvbench:roles-adapter")
    adapters = {f"route-{r}": str(build_route_adapter(model, root / f"route-{r}", r)) for r in (0, 1)}
    adapters.update({f"{ADAPTER_PREFIX}{i}": str(build_random_adapter(model, root / f"check-{i}", zero=True))
                     for i in range(2)})
    config = ServerConfig(model=model, log_path=root / "server.log", max_model_len=4096,
                          kv_transfer_config=kv_transfer_config(resolve_method(request.param)),
                          worker_extension_cls=WORKER_EXTENSION,
                          post_start_rpcs=[WorkerRpc.ATTACH_MODEL], lora_modules=adapters, extra_args=["--enforce-eager"])
    with serving(config) as server:
        yield request.param, server


def test_both_variants_answer_every_reuse_turn_along_the_readers_route(route_server) -> None:
    method, server = route_server
    tokenizer = load_tokenizer(None)
    # a table longer than vLLM's token budget per step (2048 here): the connector's own passes over
    # the source (the LR cache build) run outside vLLM's batches, whatever their length
    _, (trajectory,) = generate_trace(TraceSpec(task="role-recall", roles="role-recall", shared_tokens=2400,
                                                output_len=3, num_trajectories=1, seed=7), tokenizer)
    adapter_of = {name: f"route-{reading_of(agent.system)}" for name, agent in trajectory.agents.items()}
    gold = {a.turn_id: a.answer for a in trajectory.task.answers}
    dense = replay_turns(server, trajectory, 3, adapter_of, plan_update={"claim": "none"})
    assert {t: tokenizer.decode(ids).strip() for t, ids in dense.items()} == gold  # NonShared with adapters
    reused = replay_turns(server, trajectory, 3, adapter_of)
    assert {t: tokenizer.decode(ids).strip() for t, ids in reused.items()} == gold, method
    stats = [s for s in all_request_stats(server) if s.get("reused_tokens")]
    assert len(stats) >= 3  # A1..A3 reused A0's (or each other's) cache
    # the LR cache, counted from its tensors: r = 8 values per layer (8) in bf16, per token and adapter
    assert all(s["lr_cache_bytes_per_token_adapter"] == 2 * 8 * 8 for s in stats)


def test_kvbench_check_passes(route_server, tmp_path: Path) -> None:
    """Identity adapters (served beside the route adapters): the base model's outputs."""
    method, server = route_server
    assert all_passed(method_check(tmp_path, method, server, model=server.config.model))
