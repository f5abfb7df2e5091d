"""RelayCaching inside a real vLLM server: every reused row is computed up to the detection
layer, then only the rows whose values deviate or that the prompt's tail attends to, until the
band's last layer. Picking every row gives the dense cache; picking none leaves FullShared's
error past the detection layer."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_helpers import method_server_fixture, near_dense, reused_turn, set_params, small_replay, source_and_dense

from kvbench.server.errors import ServerError
from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine

NEVER = 1e6  # a threshold no token reaches

server = method_server_fixture("relaycaching")


@pytest.fixture(scope="module")
def det_layer(context_layer: int) -> int:
    """The method's default detection layer: the model's first context-dependent layer."""
    return context_layer


def test_detection_spans_fullshared_to_dense(server: VLLMServer, prompts: dict, det_layer: int,
                                              model_layers: int) -> None:
    source, dense = source_and_dense(server, prompts)  # A0 decoded by vLLM itself: RelayCaching needs no saved stream
    q = len(prompts["q"])
    errors, stats = {}, {}
    for name, taus in (("all", {"tau_dev": 0, "tau_inf": NEVER}), ("none", {"tau_dev": NEVER, "tau_inf": NEVER}),
                       ("default", {"tau_dev": 1.5, "tau_inf": 1.45}), ("influence", {"tau_dev": NEVER, "tau_inf": 1.45})):
        set_params(server, **taus)
        errors[name], stats[name] = reused_turn(server, prompts, source, dense)
    relay = {name: s["relay"] for name, s in stats.items()}
    assert all(r["det_layer"] == det_layer and r["candidate_tokens"] == q for r in relay.values())
    # tau_dev 0 picks every row (1 - cos >= 0): computed in every layer, the dense cache.
    assert relay["all"]["picked_tokens"] == q and all(near_dense(layer) for layer in errors["all"]), errors["all"]
    assert stats["all"]["reused_tokens"] == 0
    # Nothing picked: layers up to the detection layer are computed, the others keep the reuse error.
    assert relay["none"]["picked_tokens"] == 0
    assert all(near_dense(layer) for layer in errors["none"][:det_layer + 1]), errors["none"]
    assert not near_dense(errors["none"][-1]), errors["none"]
    assert stats["none"]["reused_tokens"] == round(q * (model_layers - det_layer - 1) / model_layers)
    # The paper's thresholds pick a minority by either criterion (Eq. 9: their union) and remove
    # part of the error past the detection layer.
    default = relay["default"]
    assert 0 < default["picked_tokens"] < q / 2
    assert max(default["deviation_tokens"], default["influence_tokens"]) <= default["picked_tokens"]
    assert default["picked_tokens"] <= default["deviation_tokens"] + default["influence_tokens"]
    assert default["influence_tokens"] > 0 and relay["influence"]["picked_tokens"] == default["influence_tokens"]
    for layer in range(det_layer + 1, model_layers):
        for kv in ("k_rel", "v_rel"):
            assert errors["default"][layer][kv] < errors["none"][layer][kv], (layer, kv, errors)
    picked = default["picked_tokens"]  # reused (token, layer) entries: the layers after det_layer, picked rows none
    assert stats["default"]["reused_tokens"] == round((q - picked) * (model_layers - det_layer - 1) / model_layers)
    set_params(server, tau_dev=1.5, tau_inf=1.45)


def test_detection_layer_must_lie_inside_the_band(server: VLLMServer, det_layer: int) -> None:
    with pytest.raises(ServerError, match=rf"the check layer \({det_layer}\) must lie in the recomputed layers "
                                          rf"\[0, {det_layer + 1}\)"):
        set_params(server, end_layer=det_layer)
    assert set_params(server, end_layer=-1)["end_layer"] == -1


def test_replay_reports_entry_reuse(server: VLLMServer, tmp_path: Path, det_layer: int, model_layers: int) -> None:
    requests, summary, stats = small_replay(server, "relaycaching", tmp_path)
    relayed = [s["relay"] for s in stats if "relay" in s]
    assert len(relayed) == 6  # A1-A3 of both trajectories; decoded outputs are reused too (no stream needed)
    assert all(0 <= r["picked_tokens"] <= r["candidate_tokens"] for r in relayed)
    assert summary["realized_rho"] == pytest.approx(requests["reused_tokens"].sum() / requests["eligible_tokens"].sum())
    # Every reused row is computed in layers 0..det_layer; picked ones (a minority) in all of them.
    after_detection = (model_layers - det_layer - 1) / model_layers
    assert after_detection / 2 <= summary["realized_rho"] <= after_detection
