"""Find the gate threshold (tau, or KVComm's gamma) that reaches a target reuse ratio rho on a
calibration trace: bisection over replays on one server, the method's state reset each time."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.methods.api.spec import ChosenMethod
from kvbench.tracegen.schema import Trace
from kvbench.tracegen.tokenizer import TraceTokenizer


@dataclass
class CalibrationStep:
    threshold: float
    realized_rho: float
    decisions: dict[str, int] = field(default_factory=dict)  # the method's segment decisions, by kind


# What a decision that served nothing from reuse says about why (the method's `decision` names).
DENSE_REASONS = {
    "dense_few_anchors": "the pool held fewer than two anchors for the edge (too few trajectories to build "
                         "anchors: more --num-trajectories or --num-warmups)",
    "dense_gate": "the gate rejected the match (what the threshold moves)",
    "dense_uncovered": "no two anchors covered the whole segment (KVComm's rule: longer contents than the "
                       "anchors go dense)",
    "dense_budget": "the reuse budget was spent",
}


def flat_rho(steps: list[CalibrationStep]) -> bool:
    """Two thresholds apart realized the same rho: the threshold does not move it on this trace."""
    thresholds = {round(s.threshold, 9) for s in steps}
    return len(thresholds) >= 2 and max(s.realized_rho for s in steps) - min(s.realized_rho for s in steps) < 1e-9


def what_limits(steps: list[CalibrationStep]) -> str:
    """Why a rho that the threshold does not move stays where it is, from the decisions of the
    last probe: how many segments went dense for which reason."""
    decisions = steps[-1].decisions
    total = sum(decisions.values())
    if not total:
        return ("the method reported no segment decision: selective recomputation (CacheBlend, RelayCaching) "
                "chooses rows, not segments, so rows its rule always keeps computing cap rho; a delta method "
                "reports none when no reuse turn was measured")
    parts = [f"{count} of {total} segments {DENSE_REASONS.get(kind, kind)}" for kind, count in
             sorted(decisions.items(), key=lambda kv: -kv[1]) if kind != "accepted"]
    return "; ".join(parts) or f"all {total} segments were accepted"


def calibrate_threshold(trace: Trace, tokenizer: TraceTokenizer, method: ChosenMethod, base_url: str, target_rho: float,
                        threshold_name: str, iterations: int = 6,
                        on_step: Callable[[CalibrationStep], None] | None = None,
                        num_warmups: int = 0, tolerance: float | None = None,
                        threshold_range: tuple[float, float] = (0.0, 1.0),
                        rho_rises: bool = True, prime_method_state: bool | None = None) -> list[CalibrationStep]:
    """Realized rho grows with a gate's threshold (a looser gate accepts more; `rho_rises` False:
    it falls, as with a share of tokens recomputed), so bisect on `threshold_range` ([0, 1]),
    stopping at a step within `tolerance` of the target, or as soon as two thresholds realize the
    same rho (`flat_rho`: the threshold is not what limits it; `what_limits` says what is). A threshold named `rho` is a reuse
    budget (GraphFlow's), which realizes about itself: its first probe is the target.
    Each replay starts from a reset method state, filled by the trace's first `num_warmups`
    trajectories (not measured), as a measured run with --prime-method-state does
    (`prime_method_state` False: the warm-ups leave it empty, as a run without that flag)."""
    prime = num_warmups > 0 if prime_method_state is None else prime_method_state
    from kvbench.experiment.run import replay_and_summarize
    from kvbench.replay.runner import ReplayConfig
    from kvbench.server.worker_rpc import WorkerClient

    def probe(threshold: float) -> CalibrationStep:
        import pandas as pd

        from kvbench import run_files
        from kvbench.analysis.metrics import method_stats_of

        WorkerClient(base_url).set_params({threshold_name: threshold})
        with tempfile.TemporaryDirectory() as tmp:
            summary = replay_and_summarize(ReplayConfig.build(
                trace=trace, tokenizer=tokenizer, method=method, base_urls=[base_url], result_dir=Path(tmp) / "run",
                qps=0, show_progress=False, num_warmups=num_warmups, prime_method_state=prime))
            decisions: dict[str, int] = {}
            requests = Path(tmp) / "run" / run_files.REQUESTS
            for stats in method_stats_of(pd.read_parquet(requests)) if requests.exists() else []:
                for decision in stats.get("decisions", []):
                    kind = str(decision.get("decision"))
                    decisions[kind] = decisions.get(kind, 0) + 1
        rho = summary.get("realized_rho")
        return CalibrationStep(threshold, float(rho) if rho is not None else 0.0, decisions)

    steps: list[CalibrationStep] = []
    low, high = threshold_range
    for index in range(iterations):
        middle = target_rho if index == 0 and threshold_name == "rho" else (low + high) / 2
        step = probe(middle)
        steps.append(step)
        if on_step is not None:
            on_step(step)
        if tolerance is not None and within(step.realized_rho, target_rho, tolerance):
            break
        if flat_rho(steps):  # more probes cannot help: the caller says what limits it
            break
        if (step.realized_rho < target_rho) == rho_rises:
            low = middle
        else:
            high = middle
    return steps


def within(realized_rho: float, target_rho: float, tolerance: float) -> bool:
    """|realized - target| <= tolerance, up to float rounding (0.75 is within 0.05 of 0.8)."""
    return abs(realized_rho - target_rho) <= tolerance + 1e-9


def best_step(steps: list[CalibrationStep], target_rho: float) -> CalibrationStep:
    return min(steps, key=lambda s: (abs(s.realized_rho - target_rho), s.threshold))


def summary_dict(steps: list[CalibrationStep], target_rho: float, threshold_name: str) -> dict[str, Any]:
    best = best_step(steps, target_rho)
    return {"target_rho": target_rho, threshold_name: best.threshold, "realized_rho": best.realized_rho,
            "steps": [{threshold_name: s.threshold, "realized_rho": s.realized_rho} for s in steps]}


@dataclass
class LayerProfile:
    """Layer-wise deviation of reused K/V from dense (DroidSpeak's offline profiling) and the
    contiguous layer group it picks."""

    deviation: list[float]  # per layer: mean over reuse turns of (K error + V error) / 2
    layers: tuple[int, int]
    turns: int


def layer_group(deviation: list[float], target_rho: float) -> tuple[int, int]:
    """The contiguous group of max(2, round((1 - rho) * L)) layers whose recomputation removes the
    most deviation. A group's first layer gets the source's K/V back (same model, same entering
    stream), so it counts only the layers after it, except at layer 0, where the group enters with
    token embeddings and is exact."""
    total = len(deviation)
    width = min(total, max(2, round((1 - target_rho) * total)))

    def gain(start: int) -> float:
        return sum(deviation[start + (1 if start else 0): start + width])

    start = max(range(total - width + 1), key=lambda s: (gain(s), s))  # ties: the deeper group
    return start, start + width


def profile_layers(trace: Trace, tokenizer: TraceTokenizer, method: ChosenMethod, base_url: str, model: str,
                   target_rho: float) -> LayerProfile:
    """Replay the trace with plain reuse (a group of layer 0 only, entering with the embeddings:
    the same K/V as reusing them), then compare every reuse turn with a dense prefill of its prompt."""
    import pandas as pd

    from kvbench import run_files
    from kvbench.replay.kv_error import reused_segments, turn_layer_errors
    from kvbench.replay.runner import ReplayConfig, run_replay
    from kvbench.server.worker_rpc import WorkerClient

    WorkerClient(base_url).set_params({"layers": [0, 1]})
    per_turn = []
    with tempfile.TemporaryDirectory() as tmp:
        run_replay(ReplayConfig.build(trace=trace, tokenizer=tokenizer, method=method, base_urls=[base_url],
                                result_dir=Path(tmp) / "run", qps=0, save_prompt_ids=True, show_progress=False))
        requests = pd.read_parquet(Path(tmp) / "run" / run_files.REQUESTS)
        for _, turn in requests[requests["success"]].iterrows():
            if reused_segments(turn):
                per_turn.append([(e["k_rel"] + e["v_rel"]) / 2 for e in turn_layer_errors(base_url, model, turn)])
    if not per_turn:
        raise ValueError("no turn of the calibration trace reused a cache: nothing to profile")
    deviation = [sum(values) / len(values) for values in zip(*per_turn)]
    layers = layer_group(deviation, target_rho)
    WorkerClient(base_url).set_params({"layers": list(layers)})
    return LayerProfile(deviation, layers, len(per_turn))
