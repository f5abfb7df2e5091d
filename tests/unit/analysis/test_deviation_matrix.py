"""analysis.deviation: the method x deviation matrix from scored runs, checked on hand-made
scores against hand-computed figures (accuracy on reuse turns, its trajectory bootstrap, the
paired gain over FullShared and its exact McNemar p-value, the NonShared noise floor)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from kvbench import run_files
from kvbench.analysis.deviation import accuracy_interval, deviation_matrix, matrix_markdown, mcnemar_p, noise_floor, write_matrix
from kvbench.analysis.runs import Run


def _run(root: Path, model: str, method: str, qps: float, correct: list[list[bool]], rho: float = 0.8,
         answers: list[list[str]] | None = None) -> Run:
    """A scored run: trajectory k's turns A0..A3 right or wrong as given (A0 is the first turn)."""
    path = root / f"{model}-{method}-{qps}"
    path.mkdir(parents=True)
    rows = []
    for k, turns in enumerate(correct):
        for i, right in enumerate(turns):
            answer = answers[k][i] if answers else ("gold" if right else "other")
            rows.append({"trajectory_id": f"t{k}", "turn_id": f"A{i}.r0", "agent": f"A{i}", "final": i == 3,
                         "reuse_turn": i > 0, "position": 0.5, "gold": "gold", "answer": answer, "correct": right})
    pd.DataFrame(rows).to_parquet(path / run_files.TASK_SCORES)
    summary = {"method": method, "label": method, "request_rate": qps, "realized_rho": rho, "p50_ttft_ms": 100.0,
               "config": {"model_identity": f"kvbench:{model}@abc",
                          "trace_header": {"generator": {"shared_tokens": 2048, "num_agents": 4, "rounds": 1}}}}
    return Run(path, summary, pd.DataFrame())


def test_matrix_figures_are_the_hand_computed_ones(tmp_path: Path) -> None:
    # FullShared gets every reuse turn wrong; the method gets 5 of 6 right (one wrong in t1).
    naive = _run(tmp_path, "roles-sparse", "fullshared", 0.0, [[True, False, False, False]] * 2, rho=1.0)
    method = _run(tmp_path, "roles-sparse", "cacheblend", 0.0, [[True, True, True, True], [True, True, False, True]])
    table = deviation_matrix([naive, method])
    row = table[table["method"] == "cacheblend"].iloc[0]
    assert row["task_accuracy_reuse"] == pytest.approx(5 / 6) and row["task_accuracy_first"] == 1.0
    assert row["reuse_turns"] == 6 and row["trajectories"] == 2 and row["model"] == "kvbench:roles-sparse"
    assert row["gain_over_fullshared"] == pytest.approx(5 / 6)
    assert row["gain_p_value"] == pytest.approx(2 * 0.5 ** 5)  # 5 discordant pairs, all one way
    # the interval resamples trajectories: t0 alone 3/3, t1 alone 2/3, both 5/6
    assert row["accuracy_low"] == pytest.approx(2 / 3) and row["accuracy_high"] == pytest.approx(1.0)
    assert math.isnan(table[table["method"] == "fullshared"].iloc[0]["gain_over_fullshared"])


def test_mcnemar_and_interval_edge_cases() -> None:
    same = pd.Series([True, False, True])
    assert mcnemar_p(same, same) == 1.0
    assert mcnemar_p(pd.Series([True] * 10), pd.Series([False] * 10)) == pytest.approx(2 * 0.5 ** 10)
    empty = pd.DataFrame({"trajectory_id": [], "correct": []})
    assert all(math.isnan(v) for v in accuracy_interval(empty))


def test_noise_floor_counts_changed_answers(tmp_path: Path) -> None:
    single = _run(tmp_path, "roles-deep", "nonshared", 0.0, [[True] * 4] * 2)
    loaded = _run(tmp_path, "roles-deep", "nonshared", 0.5, [[True] * 4, [True, True, True, False]],
                  answers=[["gold"] * 4, ["gold", "gold", "gold", "other"]])
    floor = noise_floor([single, loaded])
    assert len(floor) == 1 and floor.iloc[0]["answers_changed"] == pytest.approx(1 / 8)


def test_written_files_name_the_constructed_models(tmp_path: Path) -> None:
    runs = [_run(tmp_path, family, method, 0.0, [[True, method != "fullshared", True, True]] * 3)
            for family in ("roles-transferable", "roles-content-bound") for method in ("fullshared", "kvcmas")]
    paths = write_matrix(runs, tmp_path / "out")
    assert set(paths) == {"csv", "json", "markdown", "heatmap"} and paths["heatmap"].stat().st_size > 0
    assert "constructed test models" in paths["markdown"].read_text()
    data = json.loads(paths["json"].read_text())
    assert data["schema"] == "kvbench-deviation-matrix" and len(data["rows"]) == 4


def test_markdown_marks_significant_gains_and_missing_rho(tmp_path: Path) -> None:
    # 12 trajectories: FullShared wrong on every reuse turn, the method right on all 36 (p = 2 * 0.5^36);
    # a second method right on one trajectory's turns only (p = 2 * 0.5^3 = 0.25: not significant).
    naive = _run(tmp_path, "roles-sparse", "fullshared", 0.0, [[True, False, False, False]] * 12, rho=1.0)
    good = _run(tmp_path, "roles-sparse", "kvcmas", 0.0, [[True] * 4] * 12)
    weak = _run(tmp_path, "roles-sparse", "kvcomm", 0.0, [[True] * 4] + [[True, False, False, False]] * 11)
    dense = _run(tmp_path, "roles-sparse", "nonshared", 0.0, [[True] * 4] * 12, rho=float("nan"))
    text = matrix_markdown(deviation_matrix([naive, good, weak, dense]), noise_floor([]))
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ") and "[" in line}
    assert "**100**" in rows["kvcmas"] and "**" not in rows["kvcomm"] and "**" not in rows["fullshared"]
    assert "rho – /" in rows["nonshared"] and "nan" not in text
