"""What reuse costs in outputs: each request's output against the reference run's (NonShared, the
same trace), and PGR against a no-shared-context floor (KVShareArena's definition).

Per request (`quality.parquet`, one row per turn both runs recorded): exact match, the index of
the first token that differs (the output's length when none does), token F1 (bag of token ids,
as LongBench's and KVShareArena's word F1, over ids), whether the first generated tokens agree,
and, where both runs recorded top-K logprobs of it (`replay --logprobs`), the KL divergence
KL(reference || method) of the first-token distributions over the reference's top-K tokens plus
one bucket for the rest of the mass. A request that failed in the run scores as wrong (no match,
F1 0), as task scoring counts it; turns the reference lacks are not compared. First-agent turns
(no shared segment any earlier turn held) are reported apart from reuse turns.

PGR = (score_method - score_floor) / (score_oracle - score_floor), oracle = the reference itself
(score 1: it is what the others are compared with), floor = a `--drop-shared` run, score = mean
token F1 against the reference. Undefined (NaN, with the reason) when the oracle is not above the
floor by more than 1e-3; not clipped. The interval is a paired bootstrap over trajectories.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench import run_files

QUALITY_COLUMNS = ["trajectory_id", "turn_id", "agent", "reuse_turn", "success", "exact_match", "first_divergence",
                   "token_f1", "top1_agreement", "first_token_kl", "output_tokens", "reference_tokens"]
READ_COLUMNS = ["trajectory_id", "turn_id", "agent", "success", "reusable_tokens", "output_token_ids",
                "first_token_logprobs"]
KL_FLOOR = 1e-12  # a bucket's least probability: a mass rounded to 0 would make KL infinite
PGR_MIN_GAP = 1e-3
BOOTSTRAP_RESAMPLES = 2000


def token_f1(output: Sequence[int], reference: Sequence[int]) -> float:
    """F1 of the bags of tokens (each token counted as often as it occurs in both)."""
    if not output and not reference:
        return 1.0
    common = sum((Counter(output) & Counter(reference)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(output), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def first_divergence(output: Sequence[int], reference: Sequence[int]) -> int:
    """Index of the first differing token; the shorter length when one is a prefix of the other
    (the output's length when they are identical)."""
    for index, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return index
    return min(len(output), len(reference))


def first_token_kl(reference: dict[str, float], method: dict[str, float]) -> float:
    """KL(reference || method) in nats over the reference's top-K tokens and one bucket for the
    rest of the mass. The method's probability of a reference token its own top-K lacks is
    unknown (below its K-th): its unlisted mass is shared evenly among those tokens and the rest
    bucket, which also holds its listed tokens the reference's top-K lacks."""
    tokens = list(reference)
    p = np.array([math.exp(reference[t]) for t in tokens] + [0.0])
    p[-1] = max(0.0, 1.0 - p[:-1].sum())
    listed = {t: math.exp(v) for t, v in method.items()}
    unlisted = max(0.0, 1.0 - sum(listed.values()))
    missing = [t for t in tokens if t not in listed]
    share = unlisted / (len(missing) + 1)
    q = np.array([listed.get(t, share) for t in tokens]
                 + [share + sum(v for t, v in listed.items() if t not in reference)])
    p, q = np.maximum(p, KL_FLOOR), np.maximum(q, KL_FLOOR)
    p, q = p / p.sum(), q / q.sum()
    return float(np.sum(p * np.log(p / q)))


def _logprobs(raw: Any) -> dict[str, float] | None:
    import json

    return json.loads(raw) if isinstance(raw, str) and raw else None


def compare_outputs(requests: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """One row per (trajectory, turn) the run recorded and the reference completed."""
    ok = reference[reference["success"]]
    ref = {(str(r.trajectory_id), str(r.turn_id)): (list(r.output_token_ids), _logprobs(getattr(r, "first_token_logprobs", None)))
           for r in ok.itertuples(index=False)}
    rows = []
    for r in requests.itertuples(index=False):
        found = ref.get((str(r.trajectory_id), str(r.turn_id)))
        if found is None:
            continue
        expected, expected_top = found
        output = list(r.output_token_ids) if r.success and r.output_token_ids is not None else None
        top = _logprobs(getattr(r, "first_token_logprobs", None)) if output is not None else None
        if top and expected_top:  # the distributions' argmax; else the tokens generated (greedy: the same)
            top1 = max(top, key=top.__getitem__) == max(expected_top, key=expected_top.__getitem__)
        else:
            top1 = bool(output) and bool(expected) and output[0] == expected[0]
        rows.append({
            "trajectory_id": r.trajectory_id, "turn_id": r.turn_id, "agent": r.agent,
            "reuse_turn": bool(r.reusable_tokens and r.reusable_tokens > 0), "success": bool(r.success),
            "exact_match": output == expected,
            "first_divergence": first_divergence(output, expected) if output is not None else 0,
            "token_f1": token_f1(output, expected) if output is not None else 0.0,
            "top1_agreement": top1,
            "first_token_kl": first_token_kl(expected_top, top) if top and expected_top else math.nan,
            "output_tokens": len(output) if output is not None else 0, "reference_tokens": len(expected),
        })
    return pd.DataFrame(rows, columns=QUALITY_COLUMNS)


def quality_figures(quality: pd.DataFrame) -> dict[str, Any]:
    """The summary keys of a compared run: over every compared turn, and split into reuse turns
    and first-agent turns."""
    if not len(quality):
        return {}
    figures: dict[str, Any] = {"quality_compared_turns": len(quality)}
    for suffix, part in (("", quality), ("_reuse", quality[quality["reuse_turn"]]),
                         ("_first", quality[~quality["reuse_turn"]])):
        if not len(part):
            continue
        figures[f"exact_match_rate{suffix}"] = float(part["exact_match"].mean())
        figures[f"mean_first_divergence{suffix}"] = float(part["first_divergence"].mean())
        figures[f"mean_token_f1{suffix}"] = float(part["token_f1"].mean())
        figures[f"top1_agreement{suffix}"] = float(part["top1_agreement"].mean())
        if part["first_token_kl"].notna().any():  # only where both runs recorded logprobs
            figures[f"mean_first_token_kl{suffix}"] = float(part["first_token_kl"].mean())
    return figures


def _pgr(method: np.ndarray, floor: np.ndarray) -> float:
    """From per-trajectory mean F1s, paired: oracle score 1."""
    gap = 1.0 - float(floor.mean())
    return (float(method.mean()) - float(floor.mean())) / gap if gap > PGR_MIN_GAP else math.nan


def pgr_figures(quality: pd.DataFrame, floor: pd.DataFrame, confidence: float = 0.95,
                seed: int = 0) -> dict[str, Any]:
    """PGR of a run against its floor (both compared with the same reference), with a paired
    bootstrap interval over the trajectories both compared."""
    method_scores = quality.groupby("trajectory_id")["token_f1"].mean()
    floor_scores = floor.groupby("trajectory_id")["token_f1"].mean()
    shared = method_scores.index.intersection(floor_scores.index)
    if not len(shared):
        return {"pgr": math.nan, "pgr_low": math.nan, "pgr_high": math.nan,
                "pgr_reason": "the run and the floor compared no trajectory in common"}
    m, f = method_scores[shared].to_numpy(), floor_scores[shared].to_numpy()
    figures: dict[str, Any] = {"pgr_floor_token_f1": float(f.mean()), "pgr_trajectories": len(shared)}
    point = _pgr(m, f)
    if math.isnan(point):
        return {**figures, "pgr": math.nan, "pgr_low": math.nan, "pgr_high": math.nan,
                "pgr_reason": f"the reference is not above the floor (floor token F1 {f.mean():.4f}): "
                              "the shared context does not change the outputs"}
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(shared), size=(BOOTSTRAP_RESAMPLES, len(shared)))
    samples = np.array([_pgr(m[d], f[d]) for d in draws])
    samples = samples[~np.isnan(samples)]
    tail = (1 - confidence) / 2 * 100
    low, high = (np.percentile(samples, [tail, 100 - tail]) if len(samples) else (math.nan, math.nan))
    return {**figures, "pgr": point, "pgr_low": float(low), "pgr_high": float(high), "pgr_reason": None}


def write_quality(result_dir: Path, reference_dir: Path, floor_dir: Path | None = None) -> pd.DataFrame:
    """Compare the run in `result_dir` with the reference run into `quality.parquet`; with a
    floor run, also its PGR (`quality_pgr.json`). The summary picks both up."""
    import json

    reference = _read_requests(reference_dir)
    quality = compare_outputs(_read_requests(result_dir), reference)
    quality.to_parquet(result_dir / run_files.QUALITY, index=False)
    pgr_path = result_dir / run_files.QUALITY_PGR
    if floor_dir is not None:
        floor = compare_outputs(_read_requests(floor_dir), reference)
        figures = {**pgr_figures(quality, floor), "reference_run": str(reference_dir), "floor_run": str(floor_dir)}
        # JSON has no NaN: an undefined PGR is null, beside its reason
        figures = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in figures.items()}
        pgr_path.write_text(json.dumps(figures, indent=2) + "\n")
    elif pgr_path.exists():
        pgr_path.unlink()  # from another floor: stale
    return quality


def _read_requests(run_dir: Path) -> pd.DataFrame:
    """The columns a comparison reads (runs recorded before first-token logprobs lack that one)."""
    import pyarrow.parquet as pq

    path = run_dir / run_files.REQUESTS
    present = set(pq.read_schema(path).names)
    return pd.read_parquet(path, columns=[c for c in READ_COLUMNS if c in present])


def read_quality_figures(result_dir: Path) -> dict[str, Any]:
    import json

    path = result_dir / run_files.QUALITY
    figures = quality_figures(pd.read_parquet(path)) if path.exists() else {}
    pgr_path = result_dir / run_files.QUALITY_PGR
    if pgr_path.exists():
        figures.update(json.loads(pgr_path.read_text()))
    return figures
