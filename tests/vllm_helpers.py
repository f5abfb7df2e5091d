"""Helpers of the tests that talk to a vLLM server running the kvbench connector: requests with
a plan, dense references, the connector's RPCs and a small replay."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.contracts import CONTRACT_VERSION, Plan
from kvbench.methods.registry import resolve_method
from kvbench.server.config import method_server_config
from kvbench.server.lifecycle import VLLMServer, running_server
from kvbench.server.worker_rpc import WorkerClient

serving = running_server  # a server for a fixture: stopped in the background, awaited at the session's end


def new_key() -> str:
    return uuid.uuid4().hex[:12]


def complete(server: VLLMServer, prompt: list[int], plan: dict | None = None, salt: str | None = None,
              max_tokens: int = 1, model: str | None = None) -> dict:
    """One completion; `model` names a LoRA adapter the server serves (default: the base model)."""
    body: dict = {"model": model or server.config.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True, "logprobs": 20, "return_tokens_as_token_ids": True}
    if plan is not None:
        body["kv_transfer_params"] = Plan.from_dict({**plan, "version": CONTRACT_VERSION}).to_params()
    if salt is not None:
        body["cache_salt"] = salt
    request = urllib.request.Request(f"{server.base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]


def top_logprobs(choice: dict) -> dict[int, float]:
    return {int(k.split(":")[1]): v for k, v in choice["logprobs"]["top_logprobs"][0].items()}


def max_dlogprob(a: dict, b: dict) -> float:
    la, lb = top_logprobs(a), top_logprobs(b)
    return max(abs(la[t] - lb[t]) for t in set(la) & set(lb))


def dense_prefill(server: VLLMServer, prompt: list[int], key: str, max_tokens: int = 1) -> dict:
    """vLLM's own prefill (nothing claimed), saved under `key` as the reference cache."""
    return complete(server, prompt, {"save_as": key, "claim": "none", "segments": []}, salt=key,
                     max_tokens=max_tokens)


def reuse_q(prompts: dict, target: str, source_key: str, save_as: str, **extra) -> dict:
    """Plan for `target` ("p0"/"p1") whose q segment is reused from A0's saved cache."""
    sys_len = len(prompts["sys0"] if target == "p0" else prompts["sys1"])
    return {"save_as": save_as, "segments": [
        {"kind": "pf", "id": "system", "start": 0, "length": sys_len},
        {"kind": "ph", "id": "q", "start": sys_len, "length": len(prompts["q"]), "source": source_key,
         "source_start": len(prompts["sys0"])},
        {"kind": "pf", "id": "text", "start": sys_len + len(prompts["q"]), "length": len(prompts["tail"])}], **extra}


def kv_error(server: VLLMServer, key: str, reference: str, start: int = 0, stop: int | None = None) -> dict:
    return WorkerClient(server.base_url).kv_error(key, reference, start, stop)[0]


def request_stats(server: VLLMServer, key: str) -> dict:
    return dict(WorkerClient(server.base_url).stats()[0].requests[key])


def small_replay(server: VLLMServer, method: str, result_dir: Path) -> tuple[pd.DataFrame, dict, list[dict]]:
    """`kvbench replay` of 2 four-agent trajectories (512 shared tokens, 16-token outputs) at QPS 0,
    all successful: the requests, the summary and each request's method stats."""
    result = CliRunner().invoke(main, ["replay", "--method", method, "--base-url", server.base_url, "--qps", "0",
                                       "--num-trajectories", "2", "--shared-tokens", "512", "--output-len", "16",
                                       "--result-dir", str(result_dir)], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(result_dir / "requests.parquet")
    assert requests["success"].all() and len(requests) == 8
    return (requests, json.loads((result_dir / "summary.json").read_text()),
            requests["method_stats"].map(json.loads).tolist())


def set_params(server: VLLMServer, **params: object) -> dict:
    """Swap the server's method parameters (its learned state is dropped); returns them all."""
    return WorkerClient(server.base_url).set_params(params)


def replay_turns(server: VLLMServer, trajectory, steps: int, adapter_of: dict[str, str | None] | None = None,
                 plan_update: dict | None = None, only_q: bool = False) -> dict[str, list[int]]:
    """Every turn of `trajectory` in order, free-running (each reads this replay's own earlier
    outputs), each agent's requests under its LoRA adapter in `adapter_of` (default: the trace's):
    greedy output token ids per turn. `plan_update` goes into every plan (`{"claim": "none"}`: vLLM
    prefills everything itself, what NonShared serves; `{"inject_fault": True}`: every load fails
    and vLLM recomputes); `only_q`: the shared table is reused, not the agents' outputs."""
    from kvbench.replay.prompts import PromptBuilder, TurnPrompt
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    builder = PromptBuilder(tokenizer, tokenizer.prompt_prefix_ids, run_id=new_key())
    if adapter_of is not None:
        trajectory = trajectory.model_copy(update={"agents": {
            name: agent.model_copy(update={"adapter": adapter_of[name]}) for name, agent in trajectory.agents.items()}})
    outputs: dict[str, list[int]] = {}
    prompts: dict[str, TurnPrompt] = {}
    for turn in trajectory.turns:
        prompt = builder.build(trajectory, turn, outputs, prompts)
        plan = {**prompt.plan.to_dict(), **(plan_update or {})}
        if only_q:
            plan["segments"] = [{**seg, "source": None} if seg["id"] != "q" else seg for seg in plan["segments"]]
        choice = complete(server, prompt.token_ids, plan, salt=plan["save_as"].replace("/", "-"), max_tokens=steps,
                          model=plan["adapter"])
        outputs[turn.turn_id] = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
        prompts[turn.turn_id] = prompt
    return outputs


def all_request_stats(server: VLLMServer) -> list[dict]:
    """Every request's load stats the (first) worker holds."""
    return [dict(s) for s in WorkerClient(server.base_url).stats()[0].requests.values()]


def method_check(tmp_path: Path, methods: str, *servers: VLLMServer, expect_exit: int = 0, model: str | None = None) -> dict:
    """`kvbench check` of `methods` on running servers (small settings: three two-agent trajectories
    of 256 shared tokens, 8 generated), its check.json."""
    out = tmp_path / "check.json"
    result = CliRunner().invoke(main, ["check", "--methods", methods, *[a for s in servers for a in ("--base-url", s.base_url)],
                                       "--num-trajectories", "3", "--shared-tokens", "256", "--output-len", "8",
                                       "--output", str(out), *(("--model", model) if model else ())], prog_name="kvbench")
    assert result.exit_code == expect_exit, result.output
    return json.loads(out.read_text())


def all_passed(report: dict) -> bool:
    """Every invariant passed, each on at least one compared turn."""
    return report["passed"] and all(o["status"] == "pass" and o["turns"] > 0 for o in report["outcomes"])


def method_server(method: str, model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """Body of a module-scoped fixture: a connector server running `method` with its defaults."""
    config = method_server_config(resolve_method(method), model, max_model_len=4096,
                                  log_path=Path(tmp_path_factory.mktemp(method)) / "server.log")
    with serving(config) as server:
        yield server


def method_server_fixture(method: str) -> Callable[..., Iterator[VLLMServer]]:
    """A module-scoped `server` fixture: a connector server running `method` with its defaults
    (`server = method_server_fixture("cacheblend")` at a test module's top)."""

    @pytest.fixture(scope="module")
    def server(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
        yield from method_server(method, default_model, tmp_path_factory)

    return server


def source_and_dense(server: VLLMServer, prompts: dict) -> tuple[str, str]:
    """A0's cache of its prompt (the source a reused turn reads q from), and A1's dense cache (what
    the reused turn's should equal), both prefilled by vLLM itself."""
    source, dense = new_key(), new_key()
    dense_prefill(server, prompts["p0"], source)
    dense_prefill(server, prompts["p1"], dense)
    return source, dense


def reused_turn(server: VLLMServer, prompts: dict, source: str, dense: str) -> tuple[list[dict], dict]:
    """A1's turn reading q from `source` under the server's parameters: each layer's K/V error
    against `dense`, and the request's method stats."""
    key = new_key()
    complete(server, prompts["p1"], reuse_q(prompts, "p1", source, key), salt=key)
    return kv_error(server, key, dense, 0, len(prompts["p1"]) - 1)["layers"], request_stats(server, key)


def near_dense(layer: dict) -> bool:
    """A layer's K and V within bf16 rounding of a dense prefill's."""
    return layer["k_rel"] < 0.01 and layer["v_rel"] < 0.01
