"""The experiment driver's planning: which replays a sweep makes, on which traces, where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.experiment.sweep import MethodConfig, SweepPoint, SweepSpec
from kvbench.methods.registry import resolve_method


def test_a_product_grid_replays_every_context_at_every_qps() -> None:
    spec = SweepSpec(methods=[MethodConfig("nonshared"), MethodConfig("kvcmas", {"V": 5})],
                     shared_tokens=[256, 512], qps=[0.0, 2.0], num_trajectories=3, repeats=2, num_warmups=1)
    cells = spec.cells(Path("root"))
    assert len(cells) == 2 * 2 * 2 * 2
    assert {c.num_trajectories for c in cells} == {3}
    assert [c.method.name for c in cells[:8]] == ["nonshared"] * 8  # grouped: one server per configuration
    assert cells[-1].path == Path("root/runs/kvcmas-V5/ctx512-a4-r1-qps2-rep1")
    traces = spec.trace_specs()
    assert sorted(traces) == ["ctx256-a4-r1", "ctx512-a4-r1"]
    assert all(t.num_trajectories == 3 + 1 for t in traces.values())


def test_points_give_each_cell_its_own_trajectories_and_repeats() -> None:
    spec = SweepSpec(methods=[MethodConfig("kvcmas", {"tau": 0.4}, label="kvcmas(tau=0.4)")], num_warmups=3,
                     points=[SweepPoint(2048, 0.0, 6, 1), SweepPoint(2048, 1.0, 24, 3), SweepPoint(8192, 0.5)],
                     num_trajectories=5, repeats=2)
    cells = spec.cells(Path("r"))
    assert [(c.shared_tokens, c.qps, c.num_trajectories, c.repeat) for c in cells] == [
        (2048, 0.0, 6, 0), (2048, 1.0, 24, 0), (2048, 1.0, 24, 1), (2048, 1.0, 24, 2),
        (8192, 0.5, 5, 0), (8192, 0.5, 5, 1)]  # the last point takes the sweep's defaults
    assert cells[0].path == Path("r/runs/kvcmas(tau=0.4)/ctx2048-a4-r1-qps0-rep0")
    # one trace per context, as long as its longest cell: the short cells replay its first trajectories
    traces = spec.trace_specs()
    assert {k: t.num_trajectories for k, t in traces.items()} == {"ctx2048-a4-r1": 3 + 24, "ctx8192-a4-r1": 3 + 5}


def test_a_stored_sweep_reads_back_and_older_files_still_match() -> None:
    spec = SweepSpec(methods=[MethodConfig("fullshared")], points=[SweepPoint(512, 0.0, 2)],
                     server_options={"max_model_len": 8192})
    stored = SweepSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert stored == spec and spec.extends(stored)
    assert not SweepSpec(methods=spec.methods, points=[SweepPoint(512, 0.0, 3)]).extends(stored)
    # a sweep.json written before points, labels and server options existed resumes as it was
    old = {"methods": [{"method": "nonshared", "params": {}}], "shared_tokens": [2048], "qps": [0.0], "agents": [4],
           "rounds": [1], "workflow": "sequential", "output_len": 128, "num_trajectories": 8, "num_warmups": 1,
           "prime_method_state": False, "repeats": 1, "seed": 0, "model": None, "cpu_kv_cache_gib": 2.0,
           "request_timeout_s": 1800.0}
    assert SweepSpec(methods=[MethodConfig("nonshared")]).extends(SweepSpec.from_json(old))


def test_calibration_probes_a_budget_first_and_stops_within_tolerance(monkeypatch) -> None:
    """A threshold named rho (GraphFlow's budget) realizes about itself: the target is probed first;
    a gate threshold is bisected from 0.5; both stop at the first step within tolerance."""
    from kvbench.experiment import calibrate, run
    from kvbench.server import worker_rpc

    probes: list[float] = []

    class FakeClient:
        def __init__(self, base_url: str) -> None:
            pass

        def set_params(self, params: dict) -> dict:
            probes.append(next(iter(params.values())))
            return params

    def fake_replay(config) -> dict:
        threshold = probes[-1]
        return {"realized_rho": threshold ** 0.5 if realizes == "sqrt" else threshold * 0.98}

    monkeypatch.setattr(worker_rpc, "WorkerClient", FakeClient)
    monkeypatch.setattr(run, "replay_and_summarize", fake_replay)
    realizes = "budget"
    steps = calibrate.calibrate_threshold(None, None, resolve_method("graphflow"), "http://x", 0.8, "rho", iterations=6,
                                          tolerance=0.05)
    assert [s.threshold for s in steps] == [0.8]  # realized 0.784: within 0.05 at once
    probes.clear()
    realizes = "sqrt"
    steps = calibrate.calibrate_threshold(None, None, resolve_method("kvcmas"), "http://x", 0.8, "tau", iterations=6,
                                          tolerance=0.05)
    assert steps[0].threshold == 0.5 and calibrate.within(steps[-1].realized_rho, 0.8, 0.05)
    assert len(steps) < 6
    assert calibrate.within(0.75, 0.8, 0.05) and not calibrate.within(0.74, 0.8, 0.05)


def test_a_calibration_whose_rho_does_not_move_stops_and_says_why(monkeypatch) -> None:
    """rho 0.5 at every tau (the pool never held two anchors): the bisection stops at the second
    probe instead of suggesting more iterations, and names what limits it from the decisions."""
    import json

    import pandas as pd

    from kvbench import run_files
    from kvbench.experiment import calibrate, run
    from kvbench.server import worker_rpc

    class FakeClient:
        def __init__(self, base_url: str) -> None:
            pass

        def set_params(self, params: dict) -> dict:
            return params

    def fake_replay(config) -> dict:
        config.result_dir.mkdir(parents=True)
        stats = [json.dumps({"decisions": [{"decision": "dense_few_anchors"}, {"decision": "accepted"}]}),
                 json.dumps({"decisions": [{"decision": "dense_few_anchors"}]})]
        pd.DataFrame({"method_stats": stats}).to_parquet(config.result_dir / run_files.REQUESTS)
        return {"realized_rho": 0.5}

    monkeypatch.setattr(worker_rpc, "WorkerClient", FakeClient)
    monkeypatch.setattr(run, "replay_and_summarize", fake_replay)

    monkeypatch.setattr("kvbench.replay.runner.ReplayConfig.build", lambda **kw: type("C", (), kw)())  # no trace here
    steps = calibrate.calibrate_threshold(None, None, resolve_method("kvcmas"), "http://x", 0.8, "tau", iterations=6,
                                          tolerance=0.05)
    assert [s.threshold for s in steps] == [0.5, 0.75] and calibrate.flat_rho(steps)
    assert steps[-1].decisions == {"dense_few_anchors": 2, "accepted": 1}
    why = calibrate.what_limits(steps)
    assert why.startswith("2 of 3 segments the pool held fewer than two anchors") and "--num-warmups" in why


@pytest.mark.parametrize(("method", "target"), [("cacheblend", 0.7), ("relaycaching", 0.8)])
def test_calibration_follows_each_methods_threshold(monkeypatch, method: str, target: float) -> None:
    """CacheBlend's recompute_ratio lowers rho as it grows (rho = 1 - ratio); RelayCaching's tau_dev
    raises it over [0, 20]: each is bisected its own way to the target."""
    from kvbench.experiment import calibrate, run
    from kvbench.methods.registry import method_class
    from kvbench.server import worker_rpc

    probes: list[float] = []

    class FakeClient:
        def __init__(self, base_url: str) -> None:
            pass

        def set_params(self, params: dict) -> dict:
            probes.append(params[cls.threshold_name])
            return params

    def fake_replay(config) -> dict:
        threshold = probes[-1]
        return {"realized_rho": 1 - threshold if method == "cacheblend" else min(1.0, threshold / 10)}

    cls = method_class(method)
    monkeypatch.setattr(worker_rpc, "WorkerClient", FakeClient)
    monkeypatch.setattr(run, "replay_and_summarize", fake_replay)
    monkeypatch.setattr("kvbench.replay.runner.ReplayConfig.build", lambda **kw: type("C", (), kw)())
    steps = calibrate.calibrate_threshold(None, None, resolve_method(method), "http://x", target, cls.threshold_name,
                                          iterations=10, tolerance=0.02, threshold_range=cls.threshold_range,
                                          rho_rises=cls.rho_rises_with_threshold)
    assert calibrate.within(steps[-1].realized_rho, target, 0.02)
    assert cls.threshold_name in cls.Params.model_fields
