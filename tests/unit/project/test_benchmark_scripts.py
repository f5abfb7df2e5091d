"""The benchmark scripts run (here on the CPU, at tiny shapes) and print consistent figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_correction_timing.py"


def test_correction_timing_script_runs_on_cpu() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "64,128", "--layers", "2",
                             "--kv-heads", "2", "--head-dim", "16", "--rank", "8", "--anchors", "3", "--repeats", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("device=cpu copy bandwidth")
    rows = [line for line in lines if line.startswith("n=")]
    assert [line.split(":")[0] for line in rows] == ["n=64", "n=128"]
    steps = [line.split(":")[0].strip() for line in lines if line.startswith("  ")]
    assert steps == ["gate", "delta", "rotate"] * 2
    assert all("of copy bandwidth" in line for line in lines if line.startswith("  "))
    for row in rows:  # the total is the sum of its parts, as printed
        total, parts = row.split("correction ")[1].split(" ms = ")
        numbers = [float(part.split()[-1]) for part in parts.split(" (")[0].split(" + ")]
        assert abs(float(total) - sum(numbers)) < 0.02 + 1e-3 * float(total)


def test_delta_transfer_script_reports_bounds(default_model: str) -> None:
    """The oracle fits use the target itself, so they can never do worse than the estimates they
    generalize (best_segment spans mean_others and the zero correction; best_token spans those)."""
    script = SCRIPT.parent / "delta_transfer.py"
    result = subprocess.run([sys.executable, str(script), "--model", default_model, "--shared-tokens", "96",
                             "--contents", "3", "--rank", "4", "--dtype", "float32"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    values = {line.split()[0]: float(line.split()[1]) for line in result.stdout.splitlines()[1:]}
    assert set(values) == {"fullshared", "mean_others", "anchors_r4", "best_segment", "best_token",
                           "delta_cosine_k", "delta_cosine_v"}
    assert 0 < values["fullshared"] < 1
    assert values["best_segment"] <= min(values["mean_others"], values["fullshared"]) + 1e-6
    assert values["best_token"] <= values["best_segment"] + 1e-6
    assert -1 <= values["delta_cosine_k"] <= 1 and -1 <= values["delta_cosine_v"] <= 1


@pytest.mark.engine  # the slow tier: runs vLLM's CPU attention kernel in a subprocess (~13 s)
def test_self_attention_script_prints_both_timings_and_their_ratio() -> None:
    script = SCRIPT.parent / "bench_self_attention.py"
    result = subprocess.run([sys.executable, str(script), "--tokens", "64,200", "--repeats", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("n=")]
    assert [row.split(":")[0] for row in rows] == ["n=64", "n=200"]
    for row in rows:  # the ratio is the two printed timings' ratio
        match = re.fullmatch(r"n=\d+: sdpa ([\d.]+) ms, kernel ([\d.]+) ms, sdpa/kernel ([\d.]+)x", row)
        assert match, row
        sdpa, kernel, ratio = (float(x) for x in match.groups())
        assert sdpa > 0 and kernel > 0
        assert abs(ratio - sdpa / kernel) < 0.01 + 0.02 * ratio  # the timings print to 1 us


def test_load_waits_counts_the_steps_other_loads_ran_while_a_first_agent_waited(tmp_path: Path) -> None:
    import json

    import pandas as pd

    def request(turn: str, created: float, load_s: float, offsets: list[float], recomputed: int) -> dict:
        stats = {"load_s": load_s, "load_step_offsets_s": offsets}
        return {"turn_id": turn, "first_token_ns": int((created + load_s) * 1e9), "ttft_ms": load_s * 1e3,
                "prompt_tokens": 1000, "recomputed_tokens": recomputed, "method_stats": json.dumps(stats)}

    pd.DataFrame([
        request("A0.r0", 10.0, 1.2, [0.0, 0.3, 0.6, 0.9], 1000),  # steps at 10.0, 10.3, 10.6, 10.9
        request("A0.r0", 10.1, 2.2, [1.0, 1.3, 1.6, 1.9], 1000),  # waits [10.1, 11.1): three of those steps
        request("A1.r0", 10.5, 0.3, [0.2], 100),  # a short reuse load, one step at 10.7, inside that wait
        request("A2.r0", 12.0, 0.3, [0.0], 900),  # a dense reuse load after every wait
    ]).to_parquet(tmp_path / "requests.parquet")
    script = SCRIPT.parent / "load_waits.py"
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "first agents 2," in out and "sum 1.0 s" in out and "gaps between layers 0.30-0.30 s" in out, out
    assert "{'A0': 2, 'reuse': 1, 'reuse-dense': 1}" in out, out
    assert "steps other loads ran while a first agent waited: {'A0': 3, 'reuse': 1}" in out, out


def test_delta_benchmark_pools_repeats_and_reports_each_repeats_ratio() -> None:
    """Repeated loaded cells: the pooled p50 is the median over every repeat's requests, each
    repeat's trajectories stay their own clusters (paired across methods), and each repeat's own
    ratio is that repeat's medians' ratio."""
    import importlib.util

    import numpy as np
    import pandas as pd

    from kvbench.analysis.intervals import p50_ratio_interval

    spec = importlib.util.spec_from_file_location("bench_delta_methods", SCRIPT.parent / "bench_delta_methods.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run(ttfts: list[list[float]], reused: float = 20.0) -> pd.DataFrame:  # turn TTFTs per trajectory
        rows = []
        for t, turns in enumerate(ttfts):
            for ttft in turns:
                rows.append({"trajectory_id": f"t{t:06d}", "success": True, "ttft_ms": ttft, "tpot_ms": 10.0,
                             "e2el_ms": ttft + 100, "itl_ms": [10.0, 12.0], "scheduled_ns": 0,
                             "end_ns": int((ttft + 100) * 1e6), "prompt_tokens": 100, "output_tokens": 3,
                             "shared_tokens": 50, "reusable_tokens": 40, "reused_tokens": reused, "cached_tokens": 0})
        return pd.DataFrame(rows)

    slow = [run([[400, 410], [420, 430]], 10.0), run([[800, 810], [820, 830]], 30.0)]  # repeat 1 twice as slow
    fast = [run([[100, 110], [120, 130]]), run([[100, 110], [120, 130]])]
    pooled_slow, pooled_fast = bench.pool_repeats(slow), bench.pool_repeats(fast)
    assert sorted(set(pooled_slow["trajectory_id"])) == ["r0/t000000", "r0/t000001", "r1/t000000", "r1/t000001"]
    assert bench.pool_repeats(slow[:1]) is slow[0]  # a single run keeps its own ids

    rows = [bench.cell_row("slow", 8192, 0.5, {
        "p50_ttft_ms": float(np.median(r["ttft_ms"])), "p90_ttft_ms": 0.0, "p50_trajectory_ttft_ms": 0.0,
        "p99_itl_ms": 12.0, "failed": 0, "realized_rho": rho, "duration": duration, "mean_trajectory_e2e_ms": 1e3,
        "method_state_bytes": {"peak_anchor_pool": pool}})
        for r, duration, pool, rho in zip(slow, (10.0, 30.0), (2**20, 3 * 2**20), (0.25, 0.75))]
    row = bench.pooled_row(rows, pooled_slow)
    assert row["p50_ttft_ms"] == float(np.median([400, 410, 420, 430, 800, 810, 820, 830]))
    assert row["p50_trajectory_ttft_ms"] == float(np.median([405, 425, 805, 825]))
    assert row["duration_s"] == 20.0 and row["pool_mib"] == 3.0 and row["repeats"] == 2
    assert row["realized_rho"] == (4 * 10 + 4 * 30) / (8 * 40)  # over the pooled requests, not the first row's

    runs = {("slow", 8192, 0.5): slow, ("fast", 8192, 0.5): fast}
    each = bench.repeat_ratios(runs, "slow", "fast", 8192, 0.5, "request")
    assert each == [415 / 115, 815 / 115]
    assert bench._each(each, "x") == f"; repeats {415 / 115:.2f}x {815 / 115:.2f}x"
    assert bench._each(each[:1], "x") == ""
    interval = p50_ratio_interval(pooled_slow, pooled_fast, per="request")
    assert interval.ratio == row["p50_ttft_ms"] / 115
    assert interval.low <= interval.ratio <= interval.high


def test_recall_probe_supervises_each_hops_answer(tiny_tokenizer_dir: Path) -> None:
    """The probe's sequences: every supervised span decodes to the name one table line on from the
    previous answer (or from the latest start name), and nothing else is supervised."""
    import importlib.util
    import random

    from kvbench.tracegen.tasks.recall import ARROW
    from kvbench.tracegen.tokenizer import load_tokenizer

    spec = importlib.util.spec_from_file_location("recall_probe", SCRIPT.parent / "recall_probe.py")
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    ids, hop_of = probe.example(random.Random(4), tokenizer.encode, records=6, hops=10)
    text = tokenizer.decode(ids)
    table = dict(line.split(ARROW) for line in text.splitlines() if ARROW in line)
    assert len(table) == 6
    answers = [tokenizer.decode([t for t, h in zip(ids, hop_of) if h == hop]) for hop in range(10)]
    assert all(a.endswith("\n") for a in answers) and sum(h >= 0 for h in hop_of) == sum(
        len(tokenizer.encode(a)) for a in answers)
    # replay the rule on the text: each answer follows the last name seen (a start or an answer)
    current, checked, lines = None, 0, text.split("\n")
    for previous, line in zip(lines, lines[1:]):
        if line.startswith("Start from "):
            current = line.removeprefix("Start from ").rstrip(".")
        elif previous == "Next name:":
            assert line == table[current] == answers[checked].strip()
            current, checked = line, checked + 1
    assert checked == 10
    starts = text.count("Start from ")
    assert 1 < starts <= 10  # restarts happen


def test_same_outputs_counts_identical_turns_per_cell(tmp_path: Path) -> None:
    import pandas as pd

    def sweep(name: str, outputs: dict[str, list[int]]) -> Path:
        run = tmp_path / name / "runs" / "kvcmas" / "ctx2048-qps0"
        run.mkdir(parents=True)
        pd.DataFrame({"trajectory_id": ["t0"] * len(outputs), "turn_id": list(outputs), "success": True,
                      "output_token_ids": list(outputs.values())}).to_parquet(run / "requests.parquet")
        return tmp_path / name

    before = sweep("before", {"A0.r0": [1, 2], "A1.r0": [3, 4], "A2.r0": [5], "A3.r0": [6]})
    after = sweep("after", {"A0.r0": [1, 2], "A1.r0": [3, 9], "A2.r0": [5], "A3.r0": [6]})
    result = subprocess.run([sys.executable, str(SCRIPT.parent / "same_outputs.py"), str(before), str(after)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (row,) = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("kvcmas")]
    assert row == ["kvcmas", "ctx2048-qps0", "4", "75%"]
