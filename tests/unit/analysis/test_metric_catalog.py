"""The metric catalog (issue 65 item 5): every key it defines is produced where it says, the docs
table is its rendering, and the tables, console, compare and sweep rows read it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
from paths import DATA, ROOT

from kvbench.analysis import metric_catalog
from kvbench.analysis.metric_catalog import CATALOG, Metric

GOLDEN = DATA / "golden-runs"
STATS = ("mean", "median", "std", "p50", "p90", "p99")


def _produced_summary_keys(tmp_path: Path) -> set[str]:
    """Every key a summary can hold: a recorded run's, and those scoring, a reference, a floor
    and the load sampler add (each from its own producer, on small inputs)."""
    from kvbench.analysis.quality import pgr_figures, pgr_from_scores, quality_figures
    from kvbench.analysis.summary import summarize_run
    from kvbench.analysis.task_score import task_figures
    from kvbench.replay.machine_load import load_figures

    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "fullshared", run)
    keys = set(summarize_run(run))
    sample = {"wall_s": 1.0, "others_share": 0.2, "steal_share": 0.0, "available_bytes": 2**30, "memory_pressure": 0.1}
    keys |= set(load_figures([sample]))
    scores = pd.DataFrame({"trajectory_id": ["t0", "t0", "t1"], "agent": ["A0", "A1", "A1"], "final": [False, True, True],
                           "reuse_turn": [False, True, True], "correct": [True, True, False],
                           "parsed": ["marker", "none", "marker"]})
    keys |= set(task_figures(scores))
    quality = pd.DataFrame({"trajectory_id": ["t0", "t1", "t2"], "reuse_turn": [False, True, True],
                            "exact_match": [True, False, True], "first_divergence": [4, 1, 4],
                            "token_f1": [1.0, 0.5, 0.9], "top1_agreement": [True, True, False],
                            "first_token_kl": [0.0, 0.3, 0.1]})
    keys |= set(quality_figures(quality))
    keys |= set(pgr_figures(quality, quality.assign(token_f1=[0.2, 0.1, 0.3])))
    method, floor = pd.Series([1.0, 0.0, 1.0], index=["t0", "t1", "t2"]), pd.Series([0.0, 0.0, 0.0], index=["t0", "t1", "t2"])
    keys |= set(pgr_from_scores(method, floor))
    return keys


def _members(metric: Metric) -> list[str]:
    return metric.keys(STATS)


def test_every_summary_metric_is_a_key_some_producer_writes(tmp_path: Path) -> None:
    produced = _produced_summary_keys(tmp_path)
    missing = [key for m in CATALOG if m.record == "summary" for key in _members(m) if key not in produced]
    assert not missing, f"catalog keys no summary producer writes: {missing}"


def test_every_report_table_and_sweep_metric_is_a_column_they_produce() -> None:
    from kvbench.analysis.aggregate import runs_frame
    from kvbench.analysis.runs import find_runs
    from kvbench.analysis.tables import method_table

    runs = find_runs([GOLDEN])
    table = set(method_table(runs).columns)
    views = ("latency", "quality", "throughput", "goodput", "memory")
    shown = [m for m in CATALOG if m.views & set(views)]
    missing = [m.key for m in shown if not any(m.matches(c) for c in table)]
    assert not missing, f"report views whose metric the per-run table lacks: {missing}"
    sweep = set(runs_frame(runs).columns)
    assert set(metric_catalog.keys("sweep")) <= sweep, set(metric_catalog.keys("sweep")) - sweep


def test_the_docs_table_is_the_catalogs_rendering() -> None:
    text = (ROOT / "docs" / "results.md").read_text()
    assert metric_catalog.docs_block(text) == metric_catalog.render_markdown(), (
        "docs/results.md's metric table is stale: python -m kvbench.analysis.metric_catalog --write docs/results.md")


def test_regenerating_the_docs_replaces_only_the_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"before\n{metric_catalog.BEGIN}\nold table\n{metric_catalog.END}\nafter\n")
    assert metric_catalog.main(["--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old table" not in text
    assert metric_catalog.docs_block(text) == metric_catalog.render_markdown()


def test_keys_are_unique_and_every_entry_is_complete() -> None:
    keys = [m.key for m in CATALOG]
    assert len(keys) == len(set(keys))
    for m in CATALOG:
        assert m.description and m.unit, m.key
        assert not ("console" in m.views and not m.family and not m.label), f"{m.key}: a console metric needs a label"
        assert set(m.compared_stats) <= set(STATS), m.key


def test_lookup_resolves_families_and_turn_splits_and_refuses_the_rest() -> None:
    assert metric_catalog.lookup("p99.9_ttft_ms").key == "{stat}_ttft_ms"
    assert metric_catalog.lookup("p50_trajectory_ttft_ms").key == "{stat}_trajectory_ttft_ms"
    first = metric_catalog.lookup("task_accuracy_first")
    assert first.better == "higher" and first.source == "task" and first.key == "task_accuracy_first"
    with pytest.raises(metric_catalog.UnknownMetric, match="p50_tft_ms"):
        metric_catalog.lookup("p50_tft_ms")
    with pytest.raises(metric_catalog.UnknownMetric):
        metric_catalog.lookup("p50_ttft_ms_first")  # a split of a timing is no figure kvbench reports


def test_compare_takes_direction_and_timing_from_the_catalog() -> None:
    from kvbench.analysis.compare import Gate, timing_gates

    assert not Gate.parse("mean_first_token_kl=+10%").higher_better  # a cost
    assert Gate.parse("top1_agreement=-0.05").higher_better
    assert Gate.parse("p50_ttft_ms:nonshared/kvcmas=-10%").higher_better  # a speed-up regresses when it falls
    with pytest.raises(ValueError, match="unknown metric"):
        Gate.parse("p50_tft_ms=+10%")
    with pytest.raises(ValueError, match="neither"):
        Gate.parse("duration=+10%")
    gates = [Gate.parse(g) for g in ("p50_ttft_ms=+10%", "workflow_goodput_share=-0.05", "realized_rho=-0.05",
                                     "failed=+0%", "peak_server_rss_bytes=+10%")]
    assert [g.metric for g in timing_gates(gates)] == ["p50_ttft_ms", "workflow_goodput_share"]


def test_the_report_formats_shares_and_writes_its_legend_from_the_catalog(tmp_path: Path) -> None:
    from kvbench.analysis.report import write_report
    from kvbench.analysis.runs import find_runs

    text = write_report(find_runs([GOLDEN]), tmp_path).read_text()
    legend = text[text.index("## Columns"):]
    for key, note in metric_catalog.notes(("latency", "quality", "throughput", "goodput", "memory")):
        assert f"- `{key}`: {note}" in legend
    header = next(line for line in text.splitlines() if line.startswith("| run") and "realized_rho" in line
                  and "eligible_rho" in line)
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns == ["run", *metric_catalog.columns("throughput", columns[1:])]


def test_the_console_shows_the_catalogs_console_metrics_it_has() -> None:
    summary = {"completed": 8, "failed": 0, "p50_ttft_ms": 12.5, "mean_ttft_ms": 13.0, "realized_rho": 0.875,
               "reuse_share": None, "peak_server_rss_bytes": 3 * 2**30, "duration": 4.0}
    rows = dict(metric_catalog.console_rows(summary, ["mean", "p50"]))
    assert rows["Completed requests"] == "8" and rows["p50_ttft_ms"] == "12.50" and rows["mean_ttft_ms"] == "13.00"
    assert rows["Realized rho (reused / eligible shared tokens)"] == "0.875"
    assert rows["Peak server RSS"] == "3,072 MiB"
    assert "Reuse share (reused / shared tokens)" not in rows  # None: not measured, not shown
    assert list(rows)[:2] == ["Completed requests", "Failed requests"]  # the catalog's order
