"""KVCMAS, its non-chained ablation, KVComm and GraphFlow end to end inside vLLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from vllm_helpers import all_passed, method_check, serving

from kvbench.cli import main
from kvbench.methods.registry import resolve_method
from kvbench.server.config import method_server_config
from kvbench.server.lifecycle import VLLMServer
from kvbench.server.worker_rpc import WorkerClient

pytestmark = pytest.mark.engine

METHODS = ["kvcmas", "kvcmas-nonchained", "kvcomm", "kvcomm-ref", "graphflow"]


@pytest.fixture(scope="module", params=METHODS)
def method_server(request: pytest.FixtureRequest, default_model: str,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, VLLMServer]]:
    method = request.param
    config = method_server_config(resolve_method(method), default_model, max_model_len=4096,
                                  log_path=Path(tmp_path_factory.mktemp(method)) / "server.log")
    with serving(config) as server:
        yield method, server


def _replay(server: VLLMServer, method: str, out: Path, *extra: str):
    return CliRunner().invoke(main, ["replay", "--method", method, "--base-url", server.base_url, "--qps", "0",
                                     "--num-trajectories", "5", "--shared-tokens", "768", "--output-len", "16",
                                     "--result-dir", str(out), *extra], prog_name="kvbench")


def test_method_end_to_end(method_server: tuple[str, VLLMServer], tmp_path: Path) -> None:
    method, server = method_server
    result = _replay(server, method, tmp_path / "run")
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert requests["success"].all() and len(requests) == 20
    stats = requests["method_stats"].map(json.loads)
    decisions = [(row.trajectory_id, row.turn_id, d) for row, s in zip(requests.itertuples(), stats)
                 for d in s.get("decisions", [])]
    accepted = [(t, turn) for t, turn, d in decisions if d["decision"] == "accepted"]
    first_agent = requests["turn_id"] == "A0.r0"
    if method in ("kvcmas",):
        # Chained: the first agent is exact (dense), and no context-free reference is ever prefilled.
        assert requests.loc[first_agent, "reused_tokens"].eq(0).all()
        assert not any("reference_prefill_s" in s for s in stats)
        assert {t for t, _ in accepted} <= {"t000002", "t000003", "t000004"}  # two anchors needed first
    else:
        # Non-chained: a context-free reference of each segment is prefilled on first sight, and
        # the first agent is corrected from it too.
        assert any("reference_prefill_s" in s for s in stats)
        assert requests.loc[first_agent, "eligible_tokens"].gt(0).all()
    if method == "graphflow":  # calibrated on the first trajectory, then applied within its reuse budget
        assert {t for t, _ in accepted} <= {"t000001", "t000002", "t000003", "t000004"}
        # Its default budget, 0.8, within half a 768-token query's share of the trace (about 0.025).
        assert abs(summary["realized_rho"] - 0.8) <= 0.05
    assert accepted, "no correction was ever accepted"
    assert 0 < summary["realized_rho"] <= 1
    assert summary["method_state_bytes"]["peak_anchor_pool"] > 0
    reused = requests["reused_tokens"].sum()
    assert summary["realized_rho"] == pytest.approx(reused / requests["eligible_tokens"].sum())


def test_calibrate_finds_a_threshold(method_server: tuple[str, VLLMServer]) -> None:
    method, server = method_server
    if method == "graphflow":  # its reuse budget rho: probed at the target first, then bisected
        result = CliRunner().invoke(main, ["calibrate", "--method", method, "--target-rho", "0.6", "--base-url",
                                           server.base_url, "--num-trajectories", "4", "--shared-tokens", "512",
                                           "--output-len", "8", "--iterations", "3"], prog_name="kvbench")
        assert result.exit_code == 0, result.output
        report = json.loads(result.output[result.output.index("{"):])
        assert abs(report["realized_rho"] - 0.6) <= 0.05, report  # within half a 512-token query's share
        assert report["steps"][0]["rho"] == 0.6  # a budget is probed at the target first
        # Token counts make rho 0.33 exactly unreachable: with no tolerance, said, with a non-zero exit.
        short = CliRunner().invoke(main, ["calibrate", "--method", method, "--target-rho", "0.33", "--base-url",
                                          server.base_url, "--num-trajectories", "4", "--shared-tokens", "512",
                                          "--output-len", "8", "--iterations", "2", "--tolerance", "0"],
                                   prog_name="kvbench")
        assert short.exit_code == 1 and "out of reach" in short.output, short.output
        WorkerClient(server.base_url).set_params({"rho": 0.8})  # restore the default
        return
    if method != "kvcmas":
        pytest.skip("one gated method is enough to exercise calibration")
    result = CliRunner().invoke(main, ["calibrate", "--method", method, "--target-rho", "0.5", "--base-url",
                                       server.base_url, "--num-trajectories", "4", "--shared-tokens", "512",
                                       "--output-len", "8", "--iterations", "3", "--tolerance", "0"],
                                prog_name="kvbench")
    # the report, then (exit 1) the reason: read the JSON object alone
    report, _ = json.JSONDecoder().raw_decode(result.output[result.output.index("{"):])
    # With no tolerance every step is taken unless one lands on 0.5 exactly (then exit 0 there).
    exact = report["realized_rho"] == 0.5
    assert result.exit_code == (0 if exact else 1), result.output
    steps = report["steps"]
    thresholds = [s["tau"] for s in steps]
    assert thresholds[0] == 0.5 and (len(thresholds) == 3 or exact)
    # Bisection: each step moves toward the target (up when rho fell short, down otherwise) by half
    # the last move, and a looser gate never reuses less.
    for before, after, move in zip(steps, steps[1:], (0.25, 0.125)):
        assert after["tau"] == pytest.approx(before["tau"] + (move if before["realized_rho"] < 0.5 else -move))
    by_tau = sorted(steps, key=lambda s: s["tau"])
    assert all(a["realized_rho"] <= b["realized_rho"] for a, b in zip(by_tau, by_tau[1:])), steps
    # The reported threshold is the step whose rho came closest to the target.
    assert report["realized_rho"] == min((s["realized_rho"] for s in steps), key=lambda rho: abs(rho - 0.5))
    WorkerClient(server.base_url).set_params({"tau": 0.3})  # restore the default


def test_warmups_prime_the_anchor_pools_only_when_asked(method_server: tuple[str, VLLMServer],
                                                         tmp_path: Path) -> None:
    method, server = method_server
    if method != "kvcmas":
        pytest.skip("priming is method-independent; one method exercises it")
    pools = {}
    for name, extra in (("cold", ()), ("primed", ("--prime-method-state",))):
        result = CliRunner().invoke(main, ["replay", "--method", method, "--base-url", server.base_url, "--qps", "0",
                                           "--num-trajectories", "1", "--num-warmups", "3", "--shared-tokens", "768",
                                           "--output-len", "16", "--result-dir", str(tmp_path / name), *extra],
                                    prog_name="kvbench")
        assert result.exit_code == 0, result.output
        requests = pd.read_parquet(tmp_path / name / "requests.parquet")
        assert len(requests) == 4  # warm-ups are not recorded
        decisions = [d for s in requests["method_stats"].map(json.loads) for d in s.get("decisions", [])]
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["prime_method_state"] == (name == "primed")
        pools[name] = decisions
    # Cold: the measured trajectory meets empty pools, so every segment falls back to dense.
    assert pools["cold"] and all(d["decision"] == "dense_few_anchors" for d in pools["cold"])
    # Primed: three warm-up trajectories left anchors, so the gate runs on every segment.
    assert pools["primed"] and "dense_few_anchors" not in [d["decision"] for d in pools["primed"]]
    # ...and only they: the earlier runs on this server (same trajectory ids) left nothing behind.
    assert max(d.get("anchors", 0) for d in pools["primed"]) <= 3


def test_prematch_decides_alike_from_distances_kept_at_the_source(method_server: tuple[str, VLLMServer],
                                                                  tmp_path: Path) -> None:
    """prematch moves the matching of a saved request's segments to after its first token: later
    edges then make the same decisions from kept distances, without rebuilding the source rows."""
    method, server = method_server
    if method != "kvcmas":
        pytest.skip("prematch applies to chained sources")
    runs = {}
    try:
        for prematch in (False, True):
            WorkerClient(server.base_url).set_params({"prematch": prematch})
            out = tmp_path / f"prematch-{prematch}"
            result = _replay(server, method, out, "--num-warmups", "3", "--prime-method-state")
            assert result.exit_code == 0, result.output
            requests = pd.read_parquet(out / "requests.parquet").sort_values(["trajectory_id", "turn_id"])
            runs[prematch] = [(row.trajectory_id, row.turn_id, d) for row, s in
                              zip(requests.itertuples(), requests["method_stats"].map(json.loads))
                              for d in s.get("decisions", [])]
    finally:
        WorkerClient(server.base_url).set_params({"prematch": False})
    off, on = runs[False], runs[True]
    assert [(t, turn, d["id"]) for t, turn, d in off] == [(t, turn, d["id"]) for t, turn, d in on]
    gated = [(a, b) for (_, _, a), (_, _, b) in zip(off, on) if "entropy" in a]
    assert len(gated) >= 10
    for a, b in gated:
        assert b["entropy"] == pytest.approx(a["entropy"], abs=1e-5)
        if abs(a["entropy"] - 0.3) > 1e-3:
            assert a["decision"] == b["decision"]
    assert all(d.get("memo_anchors", 0) == 0 for _, _, d in off)
    # The query read from a loaded turn's prompt was matched ahead: no source rows rebuilt at load.
    # (A1 reads it from A0, which reused nothing: vLLM prefilled A0 and nothing matched it ahead.)
    queries = [d for _, turn, d in on if d["id"] == "q" and "entropy" in d and turn != "A1.r0"]
    assert queries and all(d["memo_anchors"] == d["anchors"] and d["rows_s"] == 0 for d in queries)


def test_kvbench_check_passes(method_server: tuple[str, VLLMServer], fullshared_server: VLLMServer,
                              tmp_path: Path) -> None:
    """Gate forced dense: NonShared's outputs and K/V; KVCMAS accepting matches with no correction
    added: FullShared's placed K/V, bit for bit."""
    method, server = method_server
    if method not in ("kvcmas", "kvcomm"):  # their gate-dense / no-budget invariants: `kvbench check` (engine time)
        pytest.skip(f"{method}'s invariant is run by kvbench check, not repeated in the engine tier")
    report = method_check(tmp_path, method, server, fullshared_server)
    assert all_passed(report), report["outcomes"]
    if method == "kvcmas":
        zero = next(o for o in report["outcomes"] if o["invariant"] == "zero-deltas")
        assert zero["details"]["max_relative_difference"] == 0.0
