"""The cache-fidelity analyses (issue 25 item 7) without vLLM: the worker-side measures on
constructed caches, and the tables built from them."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from kvbench.analysis.paper.fidelity import effective_rank, fig3_tables, fig7_tables, table2, truncation_error
from kvbench.contracts import ContractError, FidelityRequest
from kvbench.methods.connector.diagnostics import fidelity_measures


def test_effective_rank_counts_singular_values_up_to_the_energy() -> None:
    assert effective_rank([3.0, 4.0]) == 2  # 16 of 25 in the first: 64% < 90%
    assert effective_rank([10.0, 1.0, 1.0]) == 1  # 100 / 102 >= 90%
    assert effective_rank([1.0] * 10) == 9  # 9 equal values hold exactly 90%
    assert effective_rank([0.0, 0.0]) == 0
    assert truncation_error([3.0, 4.0], 1) == pytest.approx(3 / 5)
    assert truncation_error([3.0, 4.0], 2) == 0.0


def _low_rank(n: int, d: int, rank: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(n, rank, generator=generator) @ torch.randn(rank, d, generator=generator)


def test_measures_find_the_rank_of_a_planted_correction_and_the_deviating_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    layers, n, heads, hd = 3, 64, 2, 8
    reused_k = torch.randn(layers, n, heads, hd, generator=g)
    reused_v = torch.randn(layers, n, heads, hd, generator=g)
    # a rank-2 correction on keys and values, then 6 tokens whose values deviate a lot at layer 1
    delta = torch.stack([_low_rank(n, heads * hd, 2, g).view(n, heads, hd) * 0.1 for _ in range(layers)])
    target_k, target_v = reused_k + delta, reused_v + delta
    outliers = torch.tensor([3, 10, 17, 30, 41, 60])
    target_v[1, outliers] += 5.0
    answer = fidelity_measures(target_k, target_v, reused_k, reused_v, check_layer=1, recompute_tokens=6)
    assert answer["tokens"] == n and answer["feature_dim"] == heads * hd and len(answer["layers"]) == layers
    assert effective_rank(answer["layers"][0]["k_delta_sv"]) <= 2  # the planted rank
    assert effective_rank(answer["layers"][0]["k_base_sv"]) > 8  # random rows: near full rank
    # the value deviation at layer 1 picks the 6 outliers, which hold most of the error energy
    outlier_share = 0.0
    for layer in range(layers):
        for target, reused in ((target_k, reused_k), (target_v, reused_v)):
            err = (target[layer] - reused[layer]).double().square().sum(dim=(1, 2))
            outlier_share += float(err[outliers].sum()) / float(target[layer].double().square().sum())
    assert answer["deviation_removed"] == pytest.approx(outlier_share / sum(answer["layer_error"]), rel=1e-6)
    assert answer["deviation_removed"] > 0.5
    assert math.isnan(answer["attention_removed"])  # no attention given
    # exact reuse: no error, nothing to remove
    exact = fidelity_measures(target_k, target_v, target_k, target_v, check_layer=1, recompute_tokens=6,
                              attention=torch.rand(n, generator=g))
    assert sum(exact["layer_error"]) == 0 and exact["deviation_removed"] == 0 and exact["attention_removed"] == 0


def test_attention_criterion_picks_the_attended_tokens() -> None:
    g = torch.Generator().manual_seed(1)
    target = torch.randn(2, 20, 1, 4, generator=g)
    reused = target.clone()
    reused[:, [2, 5]] += 1.0  # the only errors sit on tokens 2 and 5
    attention = torch.zeros(20)
    attention[[2, 5]] = 1.0
    answer = fidelity_measures(target, target, reused, target, check_layer=0, recompute_tokens=2, attention=attention)
    assert answer["attention_removed"] == pytest.approx(1.0)
    attention_elsewhere = torch.zeros(20)
    attention_elsewhere[[7, 9]] = 1.0
    missed = fidelity_measures(target, target, reused, target, 0, 2, attention=attention_elsewhere)
    assert missed["attention_removed"] == pytest.approx(0.0)


def test_fidelity_request_refuses_a_segment_outside_its_prompt() -> None:
    good = FidelityRequest([1, 2, 3, 4], 1, 2, [9, 1, 2], 1, check_layer=0, recompute_tokens=1)
    assert FidelityRequest.from_json(good.to_json()) == good
    bad = FidelityRequest([1, 2, 3, 4], 3, 2, [9, 1, 2], 1, check_layer=0, recompute_tokens=1)
    with pytest.raises(ContractError, match="outside its prompt"):
        FidelityRequest.from_json(bad.to_json())


def _segments(errors_by_layer: dict[str, list[float]]) -> pd.DataFrame:
    rows = []
    for trajectory, errors in errors_by_layer.items():
        for layer, error in enumerate(errors):
            rows.append({"trajectory_id": trajectory, "turn_id": "A1", "segment": "q", "preceded_by": "pf",
                         "layer": layer, "layer_error": error, "tokens": 100, "recompute_tokens": 10,
                         "deviation_removed": 0.4, "attention_removed": 0.05,
                         "k_base_sv": [1.0] * 4, "v_base_sv": [1.0] * 4, "k_delta_sv": [5.0, 1.0, 0, 0],
                         "v_delta_sv": [5.0, 1.0, 0, 0]})
    return pd.DataFrame(rows)


def test_table2_scores_layer_selection_on_a_profile_from_other_trajectories() -> None:
    # layer 3 carries most error everywhere: a profile from the other trajectories finds it
    segments = _segments({"t0": [0, 1, 1, 8, 0, 0, 0, 0], "t1": [0, 1, 1, 8, 0, 0, 0, 0]})
    table = table2(segments, budget=0.1).set_index("criterion")
    layer = table.loc["layer selection (DroidSpeak)"]
    assert layer["coverage"] == pytest.approx(0.8)
    assert layer["random_coverage"] == pytest.approx(1 / 8)  # one layer of eight
    assert layer["relative_coverage"] == pytest.approx(0.8 * 8)
    deviation = table.loc["deviation selection (CacheBlend)"]
    assert deviation["coverage"] == pytest.approx(0.4) and deviation["random_coverage"] == pytest.approx(0.1)
    assert table.loc["attention selection (RelayCaching)", "relative_coverage"] == pytest.approx(0.5)
    # a layer that deviates only in the scored trajectory is not known to its offline profile
    segments = _segments({"t0": [0, 0, 0, 0, 0, 9, 1, 0], "t1": [0, 1, 0, 0, 0, 0, 0, 9]})
    layer = table2(segments, budget=0.1).set_index("criterion").loc["layer selection (DroidSpeak)"]
    assert layer["coverage"] == pytest.approx(0.0)


def test_fig7_and_fig3_tables() -> None:
    by_layer, curves = fig7_tables(_segments({"t0": [1.0] * 2}))
    assert set(by_layer["pf"]) == {1.0}  # 25 of 26 in the first value: rank 1
    assert curves[curves["rank"] == 1]["relative_error"].iloc[0] == pytest.approx(math.sqrt(1 / 26))
    errors = pd.DataFrame([
        {"method": m, "agent_index": a, "agent": f"A{a}", "layer": layer, "context_layer": layer >= 1,
         "k_sq_err": e, "k_sq_ref": 4.0, "v_sq_err": e, "v_sq_ref": 4.0}
        for m, e in (("kvcmas", 0.01), ("fullshared", 0.04)) for a in range(2) for layer in range(3)])
    per_layer, per_agent = fig3_tables(errors)
    assert per_layer.set_index("layer").loc[0, "kvcmas"] == pytest.approx(0.05)
    assert np.allclose(per_agent["fullshared"], 0.1)


def test_the_four_paper_entries_render_from_measurement_files(tmp_path) -> None:
    from kvbench.analysis.paper import fidelity
    from kvbench.analysis.paper import tables as paper

    cell = tmp_path / "runs" / "nonshared" / "ctx2048-a4-r1-qps0-rep0"
    cell.mkdir(parents=True)
    segments = _segments({"t0": [0, 1, 2, 3], "t1": [0, 2, 1, 3]})
    extra = segments.assign(preceded_by="ph", segment="out:A0")
    pd.concat([segments, extra]).assign(context=2048, budget=0.1, check_layer=1, feature_dim=4).to_parquet(
        cell / fidelity.SEGMENTS_FILE)
    errors = pd.DataFrame([{"context": 2048, "method": "kvcmas", "agent_index": a, "agent": f"A{a}", "layer": layer,
                            "context_layer": True, "k_sq_err": 0.01 * a, "k_sq_ref": 1.0, "v_sq_err": 0.01 * a,
                            "v_sq_ref": 1.0} for a in range(3) for layer in range(4)])
    errors.to_parquet(cell / fidelity.ERRORS_FILE)
    out = tmp_path / "out"
    for name in paper.FIDELITY_TABLES:
        text = paper.render(name, tmp_path, out).read_text()
        assert "## shared context 2048 tokens" in text
    assert {"fig2.png", "fig3.png", "fig7.png", "table2-2048.csv", "fig2.md", "table2.md"} <= {
        p.name for p in out.iterdir()}
    with pytest.raises(FileNotFoundError, match="kvbench paper fig2 --run"):
        fidelity.read_segments(tmp_path / "runs" / "missing")
