"""PReCache's methods inside vLLM (CPU) with LoRA adapters served: on kvbench:roles-adapter (a
constructed test model whose roles are in their V-only adapters) both rebuild each reader's values
and answer every reuse turn right, where reusing the writer's cache as it is answers the writer's
route (tests/test_role_adapters.py); with identity adapters (B = 0) and a context every agent
shares, ReBaseShared's outputs are vLLM's own prefill's, token for token."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_helpers import complete

from kvbench.contracts import WorkerRpc
from kvbench.methods.registry import WORKER_EXTENSION, kv_transfer_config
from kvbench.model.adapters import build_random_adapter
from kvbench.model.resolve import resolve_model
from kvbench.model.role_adapters import build_route_adapter
from kvbench.replay.prompts import PromptBuilder, TurnPrompt
from kvbench.replay.server import ServerConfig, VLLMServer
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.role_recall import reading_of
from kvbench.tracegen.tokenizer import load_tokenizer

pytestmark = pytest.mark.engine


def _server(method: str, model: str, adapters: dict[str, str], log: Path) -> VLLMServer:
    return VLLMServer(ServerConfig(
        model=model, log_path=log, max_model_len=2048, kv_transfer_config=kv_transfer_config(method),
        worker_extension_cls=WORKER_EXTENSION, post_start_rpcs=[WorkerRpc.ATTACH_MODEL], lora_modules=adapters,
        extra_args=["--enforce-eager"]))


def _replay(server: VLLMServer, trajectory, adapter_of: dict[str, str], dense: bool, steps: int,
            only_q: bool = False) -> dict[str, list[int]]:
    """Every turn in order, each agent under its adapter: `dense` vLLM prefills everything itself
    (NonShared), else the plan's sources are reused through the server's method (`only_q`: the
    shared table only, not the agents' outputs)."""
    tokenizer = load_tokenizer(None)
    builder = PromptBuilder(tokenizer, tokenizer.prompt_prefix_ids, run_id=uuid.uuid4().hex[:8])
    trajectory = trajectory.model_copy(update={"agents": {
        name: agent.model_copy(update={"adapter": adapter_of[name]}) for name, agent in trajectory.agents.items()}})
    outputs: dict[str, list[int]] = {}
    prompts: dict[str, TurnPrompt] = {}
    for turn in trajectory.turns:
        prompt = builder.build(trajectory, turn, outputs, prompts)
        plan = prompt.plan.to_dict()
        if dense:
            plan["claim"] = "none"
        if only_q:
            plan["segments"] = [{**seg, "source": None} if seg["id"] != "q" else seg for seg in plan["segments"]]
        choice = complete(server, prompt.token_ids, plan, salt=plan["save_as"].replace("/", "-"), max_tokens=steps,
                          model=plan["adapter"])
        outputs[turn.turn_id] = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
        prompts[turn.turn_id] = prompt
    return outputs


@pytest.fixture(scope="module", params=["precache-prelr", "precache-rebase"])
def route_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[str, VLLMServer]]:
    root = Path(tmp_path_factory.mktemp(request.param))
    model = resolve_model("kvbench:roles-adapter")
    adapters = {f"route-{r}": str(build_route_adapter(model, root / f"route-{r}", r)) for r in (0, 1)}
    with _server(request.param, model, adapters, root / "server.log") as server:
        yield request.param, server


def test_both_variants_answer_every_reuse_turn_along_the_readers_route(route_server) -> None:
    method, server = route_server
    tokenizer = load_tokenizer(None)
    _, (trajectory,) = generate_trace(TraceSpec(task="role-recall", roles="role-recall", shared_tokens=600,
                                                output_len=3, num_trajectories=1, seed=7), tokenizer)
    adapter_of = {name: f"route-{reading_of(agent.system)}" for name, agent in trajectory.agents.items()}
    gold = {a.turn_id: a.answer for a in trajectory.task.answers}
    dense = _replay(server, trajectory, adapter_of, dense=True, steps=3)
    assert {t: tokenizer.decode(ids).strip() for t, ids in dense.items()} == gold  # NonShared with adapters
    reused = _replay(server, trajectory, adapter_of, dense=False, steps=3)
    assert {t: tokenizer.decode(ids).strip() for t, ids in reused.items()} == gold, method
    stats = [s for s in request_stats_all(server) if s.get("reused_tokens")]
    assert len(stats) >= 3  # A1..A3 reused A0's (or each other's) cache
    # the LR cache, counted from its tensors: r = 8 values per layer (8) in bf16, per token and adapter
    assert all(s["lr_cache_bytes_per_token_adapter"] == 2 * 8 * 8 for s in stats)


def request_stats_all(server: VLLMServer) -> list[dict]:
    from kvbench.replay.worker_rpc import WorkerClient

    return [dict(s) for s in WorkerClient(server.base_url).stats()[0].requests.values()]


def test_rebase_with_identity_adapters_gives_vllms_own_outputs(default_model: str, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(None)
    _, (trajectory,) = generate_trace(TraceSpec(task="recall", shared_tokens=512, output_len=8, num_trajectories=1,
                                                seed=2), tokenizer)
    # one system prompt for every agent: the shared table's rows see the same context in every
    # prompt, so its adapter-free rows are what each agent's own prefill computes (an agent's
    # output follows other text in its writer's cache than in its readers' prompts: not reused here)
    system = next(iter(trajectory.agents.values())).system
    trajectory = trajectory.model_copy(update={"agents": {
        name: agent.model_copy(update={"system": system}) for name, agent in trajectory.agents.items()}})
    adapters = {f"zero-{i}": str(build_random_adapter(default_model, tmp_path / f"zero-{i}", zero=True))
                for i in range(len(trajectory.agents))}
    adapter_of = dict(zip(trajectory.agents, adapters))
    with _server("precache-rebase", default_model, adapters, tmp_path / "server.log") as server:
        dense = _replay(server, trajectory, adapter_of, dense=True, steps=8)
        reused = _replay(server, trajectory, adapter_of, dense=False, steps=8, only_q=True)
        stats = request_stats_all(server)
    assert sum(s.get("reused_tokens", 0) for s in stats) > 0
    assert reused == dense
