"""CacheBlend inside a real vLLM server: every row is computed up to the check layer, then only the
most deviating reused tokens. Recomputing all of them gives the dense cache; none of them gives
FullShared's error past the check layer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from vllm_helpers import (
    all_passed,
    method_check,
    method_server_fixture,
    near_dense,
    reused_turn,
    set_params,
    small_replay,
    source_and_dense,
)

from kvbench.server.errors import ServerError
from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine

server = method_server_fixture("cacheblend")


@pytest.fixture(scope="module")
def check_layer(context_layer: int) -> int:
    """The method's default check layer: the model's first context-dependent layer."""
    return context_layer


def test_recompute_ratio_spans_fullshared_to_dense(server: VLLMServer, prompts: dict, check_layer: int,
                                                   model_layers: int) -> None:
    source, dense = source_and_dense(server, prompts)
    n, q = len(prompts["p1"]) - 1, len(prompts["q"])
    errors = {}
    for ratio in (0.0, 0.3, 1.0):
        assert set_params(server, recompute_ratio=ratio)["recompute_ratio"] == ratio
        errors[ratio], stats = reused_turn(server, prompts, source, dense)
        picked = math.ceil(ratio * q)
        assert stats["blend"]["check_layer"] == check_layer
        assert stats["blend"]["picked_tokens"] == picked and stats["blend"]["candidate_tokens"] == q
        assert stats["reused_tokens"] == q - picked and stats["recomputed_tokens"] == n - q + picked
        # (token, layer) entries served from reuse: the unpicked rows, past the check layer only
        assert stats["served_entries"] == (q - picked) * (model_layers - check_layer - 1)
        assert stats["layers"] == model_layers
    for ratio, layers in errors.items():  # up to the check layer every row is computed: dense
        assert all(near_dense(layer) for layer in layers[:check_layer + 1]), (ratio, layers)
    assert all(near_dense(layer) for layer in errors[1.0]), errors[1.0]  # all recomputed: dense everywhere
    for layer in range(check_layer + 1, len(errors[0.0])):
        for kv in ("k_rel", "v_rel"):
            # Nothing recomputed past the check layer keeps the reuse error (well above the bf16
            # rounding of a dense recompute); recomputing the 30% most deviating tokens removes part of it.
            assert errors[0.0][layer][kv] > 2 * errors[1.0][layer][kv], errors
            assert errors[0.3][layer][kv] < errors[0.0][layer][kv], errors
    set_params(server, recompute_ratio=0.15)


def test_check_layer_must_leave_a_layer_after_it(server: VLLMServer, model_layers: int, check_layer: int) -> None:
    with pytest.raises(ServerError, match="check_layer must be in"):
        set_params(server, check_layer=model_layers - 1)
    assert set_params(server, check_layer=check_layer)["check_layer"] == check_layer


def test_replay_reports_the_reuse_ratio(server: VLLMServer, tmp_path: Path) -> None:
    requests, summary, stats = small_replay(server, "cacheblend", tmp_path)
    blended = [s["blend"] for s in stats if "blend" in s]
    assert blended and all(b["picked_tokens"] == math.ceil(0.15 * b["candidate_tokens"]) for b in blended)
    # rho counts the reused tokens not recomputed past the check layer: about 1 - 0.15.
    assert summary["realized_rho"] == pytest.approx(requests["reused_tokens"].sum() / requests["eligible_tokens"].sum())
    assert 0.8 <= summary["realized_rho"] <= 0.85
    # the reused rows still computed every layer up to the check: more computed than 1 - rho says
    assert 1 - summary["realized_rho"] < summary["recompute_share"] < 1


def test_gradual_filtering_narrows_layer_by_layer(server: VLLMServer, prompts: dict, check_layer: int,
                                                  model_layers: int) -> None:
    source, dense = source_and_dense(server, prompts)
    q = len(prompts["q"])
    errors = {}
    for filters in ([], [0.6]):
        set_params(server, recompute_ratio=0.15, filter_ratios=filters)
        errors[len(filters)], request = reused_turn(server, prompts, source, dense)
        stats = request["blend"]
        assert stats["candidate_tokens"] == q and stats["picked_tokens"] == math.ceil(0.15 * q)
    kept = math.ceil(0.6 * q)
    assert stats["filtered"] == [{"layer": check_layer, "kept_tokens": kept},
                                 {"layer": check_layer + 1, "kept_tokens": math.ceil(0.15 * q)}]
    # 60% of the reused rows computed in the layer after the check leave less error there than 15%.
    after = errors[1][check_layer + 1]["v_rel"], errors[0][check_layer + 1]["v_rel"]
    assert after[0] < after[1], errors
    set_params(server, filter_ratios=[])


def test_kvbench_check_passes(server: VLLMServer, tmp_path: Path) -> None:
    """Recompute ratio 1: NonShared's outputs and K/V."""
    assert all_passed(method_check(tmp_path, "cacheblend", server))


def test_kvbench_check_fails_a_method_broken_on_purpose(server: VLLMServer, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: CacheBlend's "recompute everything" setting recomputes no reused token after the
    check layer (ratio 0), so its reused rows keep the other agent's context: exit 1, with the
    layer whose K/V left the dense prefill's."""
    from dataclasses import replace

    from kvbench.experiment import invariants

    planted = tuple(replace(i, params=lambda facts: {"recompute_ratio": 0.0}) if i.method == "cacheblend" else i
                    for i in invariants.INVARIANTS)
    monkeypatch.setattr(invariants, "INVARIANTS", planted)
    report = method_check(tmp_path, "cacheblend", server, expect_exit=1)
    (outcome,) = report["outcomes"]
    assert outcome["status"] == "fail" and not report["passed"]
    assert "K/V off the dense prefill" in outcome["evidence"] or "NonShared's" in outcome["evidence"], outcome
    assert set_params(server)["recompute_ratio"] == 0.15  # the server is left with its own parameters
