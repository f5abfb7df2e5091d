"""The requests of `kvbench check` (kvbench.experiment.method_check): a server under check, the
check's workloads (two-agent trajectories; the same with identity adapters), and one pass of
them through a server, each prompt built from a reference pass's outputs."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvbench.contracts import Plan
from kvbench.replay.prompts import PromptBuilder, TurnPrompt
from kvbench.tracegen.schema import Trajectory

ADAPTER_PREFIX = "kvbench-check-identity-"  # the identity adapters a PReCache server must serve


@dataclass(frozen=True)
class CheckSpec:
    model: str  # what the servers load (resolved)
    shared_tokens: int = 512
    output_len: int = 16
    trajectories: int = 4  # KVCMAS's gate needs two anchors: the third trajectory is its first accepted
    seed: int = 0


@dataclass
class TurnRun:
    prompt: list[int]
    plan: Plan
    tokens: list[int]
    top: list[dict[int, float]]  # each step's top log-probs, by token id

    @property
    def key(self) -> str:
        assert self.plan.save_as is not None
        return self.plan.save_as


class CheckedServer:
    """A server under check: completions with a plan, and the connector's RPCs."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        from kvbench.server.worker_rpc import WorkerClient

        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.rpc = WorkerClient(self.base_url)
        with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=60) as response:
            self.models = [m["id"] for m in json.load(response)["data"]]
        self.served_model = self.models[0]

    @property
    def method(self) -> str:
        return self.rpc.info()[0].method

    def complete(self, prompt: list[int], plan: Plan, max_tokens: int, adapter: str | None = None) -> TurnRun:
        body = {"model": adapter or self.served_model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True,
                "cache_salt": str(plan.save_as).replace("/", "-"), "kv_transfer_params": plan.to_params()}
        request = urllib.request.Request(f"{self.base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            logprobs = json.load(response)["choices"][0]["logprobs"]
        tokens = [int(t.split(":")[1]) for t in logprobs["tokens"]]
        top = [{int(k.split(":")[1]): float(v) for k, v in step.items()} for step in logprobs["top_logprobs"]]
        return TurnRun(prompt, plan, tokens, top)

    def kv_errors(self, key: str, reference: str, stop: int) -> list[dict[str, float]]:
        from kvbench.replay.kv_error import combine_ranks

        return combine_ranks([rank["layers"] for rank in self.rpc.kv_error(key, reference, 0, stop)])

    def rows(self, key: str, layer: int, start: int, stop: int) -> dict[str, list[Any]]:
        """K and V rows of a saved cache, every rank's heads side by side."""
        ranks = self.rpc.saved_rows(key, layer, start, stop)
        return {half: [[head for rank in ranks for head in rank[half][row]] for row in range(len(ranks[0][half]))]
                for half in ("k", "v")}

    def request_stats(self) -> dict[str, dict[str, Any]]:
        """Every request's load stats the (first) worker holds, by key: one RPC for all of them."""
        return {key: dict(stats) for key, stats in self.rpc.stats()[0].requests.items()}


# ------------------------------------------------------------------------------ workloads
def check_trajectories(spec: CheckSpec, tokenizer: Any) -> list[Trajectory]:
    """Two agents in sequence: the second reuses the first's shared query and its output."""
    from kvbench.tracegen.generate import TraceSpec, generate_trace

    _, trajectories = generate_trace(TraceSpec(num_agents=2, shared_tokens=spec.shared_tokens,
                                               output_len=spec.output_len, num_trajectories=spec.trajectories,
                                               seed=spec.seed), tokenizer)
    return trajectories


def with_identity_adapters(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """The same trajectories with one system prompt for every agent (the shared query then sees
    the same context in every prompt, so its reuse is exact) and an identity adapter per agent
    (none shared: a cache written under another adapter is never copied as exact)."""
    out = []
    for trajectory in trajectories:
        system = next(iter(trajectory.agents.values())).system
        agents = {name: agent.model_copy(update={"system": system, "adapter": f"{ADAPTER_PREFIX}{i}"})
                  for i, (name, agent) in enumerate(trajectory.agents.items())}
        out.append(trajectory.model_copy(update={"agents": agents}))
    return out


def without_adapters(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    return [t.model_copy(update={"agents": {n: a.model_copy(update={"adapter": None}) for n, a in t.agents.items()}})
            for t in trajectories]


TurnKey = tuple[str, str]


def run_pass(server: CheckedServer, trajectories: Sequence[Trajectory], tokenizer: Any, run_id: str,
             reference: dict[TurnKey, list[int]] | None = None,
             plan_change: Callable[[Plan], Plan] = lambda plan: plan) -> dict[TurnKey, TurnRun]:
    """Every turn in order, each prompt built from `reference`'s outputs where given (else from
    this pass's own), its plan changed by `plan_change`."""
    builder = PromptBuilder(tokenizer, tokenizer.prompt_prefix_ids, run_id, reference_outputs=reference)
    runs: dict[TurnKey, TurnRun] = {}
    for trajectory in trajectories:
        outputs: dict[str, list[int]] = {}
        prompts: dict[str, TurnPrompt] = {}
        for turn in trajectory.turns:
            prompt = builder.build(trajectory, turn, outputs, prompts)
            plan = plan_change(prompt.plan)
            run = server.complete(prompt.token_ids, plan, turn.max_tokens, adapter=plan.adapter)
            runs[(trajectory.trajectory_id, turn.turn_id)] = run
            outputs[turn.turn_id], prompts[turn.turn_id] = run.tokens, prompt
    return runs


def dense(plan: Plan) -> Plan:
    return replace(plan, claim="none")


def only_query(plan: Plan) -> Plan:
    """Only the shared query is reused (an agent's output follows other text in its writer's cache)."""
    return replace(plan, segments=tuple(s if s.id == "q" else replace(s, source=None) for s in plan.segments))


def self_read(runs: dict[TurnKey, TurnRun], run_id: str) -> Callable[[TurnKey, TurnRun], Plan]:
    """A first agent's prompt again, every shared segment read from its own earlier cache at the
    same rows."""
    def plan_of(key: TurnKey, run: TurnRun) -> Plan:
        segments = tuple(replace(s, source=run.key, source_start=s.start, source_turn=key[1],
                                 source_agent=run.plan.agent, source_adapter=run.plan.adapter)
                         if s.kind == "ph" else s for s in run.plan.segments)
        return replace(run.plan, save_as=f"{run_id}/{key[0]}/{key[1]}", segments=segments)
    return plan_of
