"""DroidSpeak inside a real vLLM server: reused rows are recomputed in one layer group from the
residual stream their source saved entering it. A group entering with token embeddings is exact;
a later group corrects the layers after its first; rows without a saved stream are computed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from vllm_helpers import (
    all_passed,
    complete,
    dense_prefill,
    kv_error,
    method_check,
    method_server,
    new_key,
    request_stats,
    reuse_q,
    set_params,
    small_replay,
)

from kvbench.cli import main
from kvbench.model.store import first_context_layer
from kvbench.server.errors import ServerError
from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    yield from method_server("droidspeak", default_model, tmp_path_factory)


def _source(server: VLLMServer, prompt: list[int]) -> str:
    """A0's cache computed by the connector's partial forward (so it saves its residual stream)."""
    key = new_key()
    complete(server, prompt, {"save_as": key, "segments": [{"kind": "pf", "id": "all", "start": 0,
                                                              "length": len(prompt)}]}, salt=key)
    return key


def _reused_errors(server: VLLMServer, prompts: dict, source: str, dense: str) -> tuple[list[dict], dict]:
    key = new_key()
    complete(server, prompts["p1"], reuse_q(prompts, "p1", source, key), salt=key)
    return kv_error(server, key, dense, 0, len(prompts["p1"]) - 1)["layers"], request_stats(server, key)


def test_layer_groups_against_dense(server: VLLMServer, prompts: dict, default_model: str, model_layers: int) -> None:
    first = first_context_layer(default_model)  # 1 in a standard model; the recall model's K/V before it are local
    dense = new_key()
    dense_prefill(server, prompts["p1"], dense)  # what A1's cache should be
    n, q = len(prompts["p1"]) - 1, len(prompts["q"])
    errors, stats = {}, {}
    for layers in ([0, model_layers], [first, model_layers], [model_layers - 1, model_layers]):
        assert set_params(server, layers=layers)["layers"] == layers
        errors[tuple(layers)], stats[tuple(layers)] = _reused_errors(server, prompts, _source(server, prompts["p0"]),
                                                                     dense)
    close = lambda layer: layer["k_rel"] < 0.01 and layer["v_rel"] < 0.01  # noqa: E731 - bf16 rounding
    # Entering with the token embeddings, every layer of the group is exact: all of them here.
    assert all(close(layer) for layer in errors[(0, model_layers)]), errors[(0, model_layers)]
    assert stats[(0, model_layers)]["reused_tokens"] == 0 and stats[(0, model_layers)]["recomputed_tokens"] == n
    # A 1-layer group gets the source's own K/V back (they depend on the entering stream only):
    # FullShared's error, which is well above bf16 rounding in the deepest layers.
    fullshared = errors[(model_layers - 1, model_layers)]
    assert not close(fullshared[-1]), fullshared
    # A group from the first context-dependent layer: that layer is the source's, the later ones
    # see A1's context through attention. The entering stream already carries A0's context (the
    # layer before attended to it), so only part of the error goes: 13-20% per layer on the
    # 4-layer kvbench:tiny, measured.
    group = errors[(first, model_layers)]
    for kv in ("k_rel", "v_rel"):
        assert group[first][kv] == pytest.approx(fullshared[first][kv], rel=0.05, abs=2e-3), (group, fullshared)
        for layer in range(first + 1, model_layers):
            assert group[layer][kv] < 0.93 * fullshared[layer][kv], (layer, kv, group, fullshared)
    # rho counts (token, layer) entries: q's rows are served from reuse in the layers before the group.
    assert stats[(first, model_layers)]["reused_tokens"] == round(q * first / model_layers)
    assert stats[(first, model_layers)]["recomputed_tokens"] == n - round(q * first / model_layers)
    assert stats[(first, model_layers)]["dense_without_stream_tokens"] == 0
    set_params(server, layers=None)


def test_rows_without_a_saved_stream_are_computed(server: VLLMServer, prompts: dict) -> None:
    assert set_params(server, layers=None)["layers"] is None  # default: the deepest 20% of layers, at least 2
    source, dense = new_key(), new_key()
    dense_prefill(server, prompts["p0"], source)  # prefilled by vLLM itself: no residual stream saved
    dense_prefill(server, prompts["p1"], dense)
    errors, stats = _reused_errors(server, prompts, source, dense)
    assert stats["reused_tokens"] == 0 and stats["dense_without_stream_tokens"] == len(prompts["q"])
    assert all(layer["k_rel"] < 0.01 and layer["v_rel"] < 0.01 for layer in errors), errors


def test_layer_group_must_fit_the_model(server: VLLMServer, model_layers: int) -> None:
    with pytest.raises(ServerError, match=rf"recomputed layers \[2, {model_layers + 2}\) must be"):
        set_params(server, layers=[2, model_layers + 2])
    assert set_params(server, layers=None)["layers"] is None


def test_replay_reports_layer_weighted_reuse(server: VLLMServer, tmp_path: Path, model_layers: int) -> None:
    requests, summary, stats = small_replay(server, "droidspeak", tmp_path)
    later = [s for s, agent in zip(stats, requests["agent"]) if agent != "A0"]
    # The query is reused in the layers outside the default group; the agents' outputs
    # (generated by vLLM, no saved stream) are computed.
    assert all(s["dense_without_stream_tokens"] > 0 for s in later if s["agent"] in ("A2", "A3"))
    assert summary["realized_rho"] == pytest.approx(requests["reused_tokens"].sum() / requests["eligible_tokens"].sum())
    outside_group = (model_layers - max(2, round(0.2 * model_layers))) / model_layers  # the query's share at most
    assert outside_group / 2 <= summary["realized_rho"] <= outside_group


def test_calibrate_profiles_the_layer_group(server: VLLMServer, model_layers: int) -> None:
    result = CliRunner().invoke(main, ["calibrate", "--method", "droidspeak", "--target-rho", "0.5", "--base-url",
                                       server.base_url, "--num-trajectories", "1", "--shared-tokens", "512",
                                       "--output-len", "8"], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    deviation = report["layer_deviation"]
    assert len(deviation) == model_layers and report["profiled_turns"] == 3  # A1-A3 reuse the query
    # Reused layer-0 K/V depend on the token and its position only: exact up to bf16 rounding;
    # deeper layers carry the source's context.
    assert deviation[0] < 0.01 < max(deviation[1:])
    start, stop = report["layers"]
    assert stop - start == round(0.5 * model_layers)
    assert set_params(server, reuse_ratio=0.8)["layers"] == [start, stop]  # the profile's group is in force
    set_params(server, layers=None)


def test_kvbench_check_passes(server: VLLMServer, tmp_path: Path) -> None:
    """Every layer recomputed: NonShared's outputs and K/V."""
    assert all_passed(method_check(tmp_path, "droidspeak", server))
