"""Loads spread over engine steps (`max_load_tokens_per_step`): the connector answers vLLM's
scheduler with an asynchronous load, runs a few partial-forward layers of the waiting loads in
each engine step and reports the request loaded when its last layer is done. The cache must be
the one a load in a single step makes, and the running requests must keep decoding meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from vllm_helpers import complete, dense_prefill, kv_error, max_dlogprob, new_key, request_stats, serving

from kvbench.contracts import CONTRACT_VERSION, Plan
from kvbench.methods.registry import resolve_method
from kvbench.replay.backend import stream_completion
from kvbench.server.config import method_server_config
from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine

BUDGET = 128  # tokens per engine step: 512 rows through one layer; a 1.5K-row load takes a layer per step


@pytest.fixture(scope="module")
def server(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """KVCMAS with asynchronous loads; plans with inject_fault make their load fail."""
    config = method_server_config(resolve_method("kvcmas"), default_model, max_load_tokens_per_step=BUDGET, max_model_len=4096,
                                  log_path=Path(tmp_path_factory.mktemp("async-loads")) / "server.log")
    assert config.kv_transfer_config is not None
    config.kv_transfer_config["kv_connector_extra_config"]["fault_injection"] = "flagged"
    with serving(config) as server:
        yield server


def _params(plan: dict) -> dict:
    return Plan.from_dict({**plan, "version": CONTRACT_VERSION}).to_params()


def _compute_all(prompt: list[int], key: str) -> dict:
    """A plan that claims the prompt and computes every row in the connector's partial forward."""
    return {"save_as": key, "claim": "all", "segments": [{"kind": "pf", "id": "all", "start": 0, "length": len(prompt)}]}


def test_a_load_over_engine_steps_matches_dense(server: VLLMServer, prompts: dict, bf16_noise: dict,
                                                 model_layers: int) -> None:
    dense_key, key = new_key(), new_key()
    dense = dense_prefill(server, prompts["p0"], dense_key)
    computed = complete(server, prompts["p0"], _compute_all(prompts["p0"], key), salt=key)
    assert max_dlogprob(dense, computed) <= bf16_noise["p0"]
    n = len(prompts["p0"]) - 1
    error = kv_error(server, key, dense_key, 0, n)
    assert all(layer["k_rel"] < 0.01 and layer["v_rel"] < 0.01 for layer in error["layers"]), error
    stats = request_stats(server, key)
    assert stats["recomputed_tokens"] == n and stats["reused_tokens"] == 0
    assert stats["load_steps"] == model_layers  # n >= 512 rows: one layer per engine step


def test_a_failed_load_is_computed_by_vllm(server: VLLMServer, prompts: dict, bf16_noise: dict) -> None:
    """A load that fails ends the request's wait as failed: vLLM computes the prompt itself
    (once: the connector does not claim it again), and the answer is the dense one."""
    key = new_key()
    dense = dense_prefill(server, prompts["p1"], new_key(), max_tokens=16)
    faulty = complete(server, prompts["p1"], {**_compute_all(prompts["p1"], key), "inject_fault": True},
                       salt=key, max_tokens=16)
    assert faulty["text"] == dense["text"]
    assert max_dlogprob(dense, faulty) <= bf16_noise["p1"]
    stats = request_stats(server, key)
    assert stats["fallback"] == "dense" and "injected fault" in stats["error"]


def test_running_requests_decode_between_the_steps_of_a_load(server: VLLMServer, prompts: dict,
                                                             model_layers: int) -> None:
    """A request decoding while a long load runs is computed in every engine step the load runs in:
    it gets a token between each two layers of the load, where a load in one step (budget 0) holds
    it for the whole load. Checked from the engine's own record of each step's batch, not from
    token arrival times, which a busy machine stretches (the ITL gain is measured in
    reports/archive/benchmarks-cpu-2026-11.md)."""

    async def scenario() -> tuple:
        url = f"{server.base_url}/v1/completions"
        common = {"model": server.config.model, "temperature": 0, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session:
            decoding = asyncio.create_task(stream_completion(
                session, url, {**common, "prompt": prompts["q"][:64], "max_tokens": 1500}, 300, "decoding"))
            await asyncio.sleep(1.0)  # the first request is past its prefill and decoding
            key = new_key()
            load = await stream_completion(session, url, {
                **common, "prompt": prompts["p1"], "max_tokens": 1, "cache_salt": key,
                "kv_transfer_params": _params(_compute_all(prompts["p1"], key))}, 300, "load")
            return await decoding, load, key

    decoding, load, key = asyncio.run(scenario())
    assert decoding.success and load.success, (decoding.error_message, load.error_message)
    assert load.sent_ns > decoding.first_token_ns and decoding.end_ns > load.first_token_ns  # overlapped
    stats = request_stats(server, key)
    assert stats["load_steps"] == model_layers
    # The decoding request is the only other one: it was computed in each of the load's steps.
    assert stats["load_step_batches"] == [1] * model_layers, stats["load_step_batches"]
    # one offset per step, in step order, within the load's own time; nothing queued before it
    offsets = stats["load_step_offsets_s"]
    assert len(offsets) == model_layers and offsets == sorted(offsets) and len(set(offsets)) == model_layers, offsets
    assert 0 <= offsets[0] < offsets[-1] <= stats["load_s"], (offsets, stats["load_s"])


def test_the_load_budget_reaches_the_connector() -> None:
    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.cli.server_options import ServerOptions
    from kvbench.methods.api.base import MethodConfigError
    from kvbench.methods.connector.settings import ConnectorSettings
    from kvbench.methods.registry import method_keys

    options = ServerOptions(model=None, max_model_len=None, cpu_kv_cache_gib=2.0, startup_timeout_s=60.0,
                            method_params=(), vllm_args=(), max_load_tokens_per_step=512, max_store_bytes=None,
                            fault_injection=None)
    extra = options.server_config(resolve_method("kvcmas"), "model").kv_transfer_config["kv_connector_extra_config"]
    assert ConnectorSettings.from_extra_config(extra).max_load_tokens_per_step == 512
    # plain vLLM: no connector to configure
    assert options.server_config(resolve_method("nonshared"), "model").kv_transfer_config is None
    with pytest.raises(MethodConfigError, match="max_load_tokens_per_step"):
        ConnectorSettings.from_extra_config({**method_keys("kvcmas"), "max_load_tokens_per_step": -1})
    # every command that starts a server takes the flag
    for command in ("replay", "serve", "calibrate"):
        result = CliRunner().invoke(main, [command, "--help"])
        assert result.exit_code == 0 and "--max-load-tokens-per-step" in result.output, (command, result.output)


def test_a_short_load_goes_ahead_of_a_long_one_queued_before_it(server: VLLMServer, prompts: dict,
                                                                model_layers: int) -> None:
    """Loads waiting together run least work first: a load of a few rows sent right after a long
    one ends in one engine step, and its request gets its first token while the long load still
    runs its layers. In arrival order it would wait for every layer of the long one."""

    async def scenario() -> tuple:
        url = f"{server.base_url}/v1/completions"
        common = {"model": server.config.model, "temperature": 0, "ignore_eos": True, "stream": True, "max_tokens": 1}
        long_key, short_key = new_key(), new_key()
        short_prompt = prompts["q"][:32]
        async with aiohttp.ClientSession() as session:
            long = asyncio.create_task(stream_completion(session, url, {
                **common, "prompt": prompts["p1"], "cache_salt": long_key,
                "kv_transfer_params": _params(_compute_all(prompts["p1"], long_key))}, 300, "long"))
            await asyncio.sleep(0.02)  # sent after the long one, while its load runs (4 engine steps)
            short = await stream_completion(session, url, {
                **common, "prompt": short_prompt, "cache_salt": short_key,
                "kv_transfer_params": _params(_compute_all(short_prompt, short_key))}, 300, "short")
            return await long, short, long_key, short_key

    long, short, long_key, short_key = asyncio.run(scenario())
    assert long.success and short.success, (long.error_message, short.error_message)
    long_stats, short_stats = request_stats(server, long_key), request_stats(server, short_key)
    assert long_stats["load_steps"] == model_layers and short_stats["load_steps"] == 1, (long_stats, short_stats)
    assert short.sent_ns > long.sent_ns and short.first_token_ns < long.first_token_ns
