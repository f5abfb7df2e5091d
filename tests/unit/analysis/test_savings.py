"""The report's reuse-turn table: ratios against NonShared's same turns, with intervals over
trajectories, computed from runs made up here with known TTFTs."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.analysis.runs import Run
from kvbench.analysis.savings import reuse_turn_savings

GENERATOR = {"shared_tokens": 8192, "num_agents": 2, "rounds": 1, "seed": 0}


def _run(method: str, first_ms: float, reuse_ms: float, trajectories: int = 6, model: str = "m",
         comparison: str | None = None, label: str | None = None, started: float = 0.0, noise: float = 0.01) -> Run:
    rows = []
    for t in range(trajectories):
        jitter = 1 + noise * (t % 3 - 1)
        rows.append({"trajectory_id": f"t{t}", "turn_id": "A0.r0", "success": True, "reusable_tokens": 0,
                     "ttft_ms": first_ms * jitter})
        rows.append({"trajectory_id": f"t{t}", "turn_id": "A1.r0", "success": True, "reusable_tokens": 8000,
                     "ttft_ms": reuse_ms * jitter})
    config = {"model": model, "trace_header": {"generator": GENERATOR}, "segments": [{"started": started}]}
    if comparison is not None:
        config["comparison"] = {"id": comparison, "interleaved": True}
    summary = {"method": method, "request_rate": 0.0, "config": config, **({"label": label} if label else {})}
    return Run(Path(label or method), summary, pd.DataFrame(rows))


def test_reuse_turns_are_compared_with_nonshareds_same_turns() -> None:
    table = reuse_turn_savings([_run("nonshared", 500, 520), _run("fullshared", 510, 150), _run("kvcmas", 520, 208)])
    rows = table.set_index("run")
    assert list(rows.index) == ["fullshared ctx=8192 a=2 r=1 qps=0", "kvcmas ctx=8192 a=2 r=1 qps=0"]
    kvcmas = rows.loc["kvcmas ctx=8192 a=2 r=1 qps=0"]
    assert kvcmas["reuse_turns"] == 6 and kvcmas["p50_reuse_ttft_ms"] == 208
    # Every run's trajectory t is slowed alike (the same jitter): paired by trajectory, every resample's
    # ratio is the exact one, so the interval is a point (unpaired resamples would spread it)
    assert kvcmas["reuse_vs_nonshared"] == "0.40 [0.40, 0.40]"  # 208 / 520
    assert kvcmas["reuse_vs_fullshared"] == "1.39 [1.39, 1.39]"  # 208 / 150
    assert kvcmas["first_vs_nonshared"] == "1.04 [1.04, 1.04]"  # 520 / 500
    assert kvcmas["reuse_finding"] == "faster (no A/A arm: noise floor unknown)" and kvcmas["reuse_noise_floor"] == ""
    assert rows.loc["fullshared ctx=8192 a=2 r=1 qps=0", "reuse_vs_fullshared"] == ""


def test_no_nonshared_run_or_another_model_gives_no_row() -> None:
    assert reuse_turn_savings([_run("fullshared", 500, 150), _run("kvcmas", 500, 200)]).empty
    assert reuse_turn_savings([_run("nonshared", 500, 520), _run("kvcmas", 500, 200, model="other")]).empty
    one = reuse_turn_savings([_run("nonshared", 500, 520, trajectories=1), _run("kvcmas", 500, 200, trajectories=1)])
    assert one.iloc[0]["reuse_vs_nonshared"] == "n/a (fewer than 2 trajectories)"


def test_runs_are_paired_within_their_comparison_and_beside_its_noise_floor() -> None:
    """Two quickstarts in one folder: each method against its own comparison's NonShared (the second
    machine twice as slow), rows told apart by when their comparison started, the A/A arm's ratio
    beside every ratio and a ratio inside it no finding."""
    from kvbench.analysis.runs import tag_comparisons

    first = [_run("nonshared", 500, 520, comparison="q1", started=1e9),
             _run("nonshared", 505, 525, comparison="q1", label="nonshared-aa", started=1e9, noise=0.05),
             _run("kvcmas", 500, 200, comparison="q1", started=1e9),
             _run("fullshared", 510, 515, comparison="q1", started=1e9)]
    second = [_run("nonshared", 1000, 1040, comparison="q2", started=2e9),
              _run("kvcmas", 1000, 400, comparison="q2", started=2e9)]
    runs = first + second
    tag_comparisons(runs)
    assert len({run.cell for run in runs}) == len(runs)  # every row its own name, the first NonShared "@01-0.."
    rows = reuse_turn_savings(runs).set_index("run")
    kvcmas_rows = [name for name in rows.index if name.startswith("kvcmas")]
    assert len(kvcmas_rows) == 2 and all(rows.loc[name, "reuse_vs_nonshared"].startswith("0.38 [")
                                         for name in kvcmas_rows)  # 200 / 520 and 400 / 1040: never across
    aa = rows.loc[next(name for name in rows.index if name.startswith("nonshared-aa"))]
    assert aa["reuse_finding"] == "noise floor" and aa["reuse_vs_nonshared"].startswith("1.01 [")
    q1_kvcmas = rows.loc[next(name for name in kvcmas_rows if first[2].cell == name)]
    assert q1_kvcmas["reuse_noise_floor"] == aa["reuse_vs_nonshared"] and q1_kvcmas["reuse_finding"] == "faster"
    fullshared = rows.loc[next(name for name in rows.index if name.startswith("fullshared"))]
    assert fullshared["reuse_finding"] == "within noise"  # 515 / 520: inside the A/A arm's spread
    q2_kvcmas = rows.loc[next(name for name in kvcmas_rows if second[1].cell == name)]
    assert q2_kvcmas["reuse_noise_floor"] == "" and q2_kvcmas["reuse_finding"].startswith("faster (no A/A arm")


def test_a_ratio_is_a_finding_only_outside_one_and_the_noise_floor() -> None:
    from kvbench.analysis.intervals import RatioInterval
    from kvbench.analysis.savings import finding

    floor = RatioInterval(1.0, 0.9, 1.1, 0.95)
    assert finding(RatioInterval(0.5, 0.4, 0.6, 0.95), floor) == "faster"
    assert finding(RatioInterval(1.5, 1.3, 1.7, 0.95), floor) == "slower"
    assert finding(RatioInterval(0.85, 0.8, 0.95, 0.95), floor) == "within noise"  # excludes 1, meets the floor
    assert finding(RatioInterval(0.9, 0.7, 1.05, 0.95), None) == "within noise"
    # an interval that reaches 1, or the floor, exactly does not exclude it
    assert finding(RatioInterval(0.9, 0.8, 1.0, 0.95), None) == "within noise"
    assert finding(RatioInterval(1.1, 1.0, 1.2, 0.95), None) == "within noise"
    assert finding(RatioInterval(0.8, 0.7, 0.9, 0.95), floor) == "within noise"
    assert finding(RatioInterval(1.2, 1.1, 1.3, 0.95), floor) == "within noise"
    assert finding("n/a", floor) == ""


def test_the_verdict_opens_with_each_methods_saving_beside_the_noise_floor_and_the_load() -> None:
    from kvbench.analysis.reuse_cost import reuse_turn_costs
    from kvbench.analysis.verdict import load_line, verdict_lines

    runs = [_run("nonshared", 500, 520, comparison="q"), _run("nonshared", 505, 525, comparison="q", label="nonshared-aa",
                                                              noise=0.05),
            _run("kvcmas", 500, 200, comparison="q"), _run("fullshared", 510, 515, comparison="q")]
    for run, share in zip(runs, (0.01, 0.02, 0.03, 0.35)):
        run.summary.update(others_cpu_share=share, machine_loaded=share > 0.1)
    lines = verdict_lines(runs, reuse_turn_savings(runs), reuse_turn_costs(runs))
    assert len(lines) == 2  # the methods; NonShared and its A/A arm are what they are read against
    kvcmas = next(line for line in lines if "**kvcmas" in line)
    assert "0.38 [" in kvcmas and "**faster**" in kvcmas and "noise floor: NonShared's own 1.01 [" in kvcmas
    assert "**within noise**" in next(line for line in lines if "**fullshared" in line)
    assert "outputs not compared with a reference" in kvcmas  # no quality here: said, not left out
    text = load_line(runs)
    assert "1%-35%" in text and "**loaded**" in text and "fullshared" in text
    assert "quiet" in load_line(runs[:3])
