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

PGR = (score_method - score_floor) / (score_oracle - score_floor), KVShareArena's definition over
a task's score: `pgr` on a task trace (final answers right; the oracle, the reference, scores its
own accuracy). Over the outputs themselves, `output_pgr`: score = mean token F1 against the
reference (the oracle's own score is 1: it is what the others are compared with). Floor = a
`--drop-shared` run. Undefined (NaN, with the reason) when the oracle is not above the floor by
more than 1e-3; not clipped. The interval is a paired bootstrap over trajectories; against naive
reuse (FullShared) the gain in PGR gets one too, with a Wilcoxon signed-rank p-value over the
per-trajectory score differences.
"""

from __future__ import annotations

import json
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
    return json.loads(raw) if isinstance(raw, str) and raw else None


def compare_outputs(requests: pd.DataFrame, reference: pd.DataFrame, first_token_only: bool = False) -> pd.DataFrame:
    """One row per (trajectory, turn) the run recorded and the reference completed; a run whose
    requests stopped at their first token (the paper's protocol) against the reference's first."""
    ok = reference[reference["success"]]
    ref = {(str(r.trajectory_id), str(r.turn_id)): (list(r.output_token_ids), _logprobs(getattr(r, "first_token_logprobs", None)))
           for r in ok.itertuples(index=False)}
    rows = []
    for r in requests.itertuples(index=False):
        found = ref.get((str(r.trajectory_id), str(r.turn_id)))
        if found is None:
            continue
        expected, expected_top = found
        expected = expected[:1] if first_token_only else expected
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


# Key prefixes: KVShareArena's PGR over a task's score, and PGR over token F1 against the reference.
TASK_PGR = "pgr"
OUTPUT_PGR = "output_pgr"
PGR_SCHEMA = 2  # quality_pgr.json: 2 since the two were named so (before: pgr = output, pgr_task = task)


def _pgr(method: np.ndarray, floor: np.ndarray, oracle: np.ndarray) -> float:
    """From per-trajectory scores, paired."""
    gap = float(oracle.mean()) - float(floor.mean())
    return (float(method.mean()) - float(floor.mean())) / gap if gap > PGR_MIN_GAP else math.nan


def _interval(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    samples = samples[~np.isnan(samples)]
    if not len(samples):
        return math.nan, math.nan
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def pgr_from_scores(method: pd.Series, floor: pd.Series, oracle: pd.Series | None = None,
                    naive: pd.Series | None = None, prefix: str = TASK_PGR, confidence: float = 0.95,
                    seed: int = 0) -> dict[str, Any]:
    """PGR from per-trajectory scores (indexed by trajectory id) of the method, the floor, the
    oracle (None: 1 everywhere, the reference compared with itself) and optionally naive reuse
    (FullShared): the point, a paired bootstrap interval over the trajectories all of them scored,
    and against naive reuse the gain in PGR, its interval and a Wilcoxon signed-rank p-value of
    the per-trajectory score differences."""
    common = method.index.intersection(floor.index)
    for other in (oracle, naive):
        if other is not None:
            common = common.intersection(other.index)
    undefined = {prefix: math.nan, f"{prefix}_low": math.nan, f"{prefix}_high": math.nan}
    if not len(common):
        return {**undefined, f"{prefix}_reason": "the runs scored no trajectory in common"}
    m, f = method[common].to_numpy(float), floor[common].to_numpy(float)
    o = oracle[common].to_numpy(float) if oracle is not None else np.ones(len(common))
    figures: dict[str, Any] = {f"{prefix}_floor_score": float(f.mean()), f"{prefix}_oracle_score": float(o.mean()),
                               f"{prefix}_trajectories": len(common)}
    point = _pgr(m, f, o)
    if math.isnan(point):
        return {**figures, **undefined,
                f"{prefix}_reason": f"the oracle ({o.mean():.4f}) is not above the floor ({f.mean():.4f}) by "
                                    f"{PGR_MIN_GAP:g}: the shared context does not change the score"}
    draws = np.random.default_rng(seed).integers(0, len(common), size=(BOOTSTRAP_RESAMPLES, len(common)))
    low, high = _interval(np.array([_pgr(m[d], f[d], o[d]) for d in draws]), confidence)
    figures.update({prefix: point, f"{prefix}_low": low, f"{prefix}_high": high, f"{prefix}_reason": None})
    if naive is not None:
        from scipy import stats

        n = naive[common].to_numpy(float)
        gains = np.array([_pgr(m[d], f[d], o[d]) - _pgr(n[d], f[d], o[d]) for d in draws])
        gain_low, gain_high = _interval(gains, confidence)
        differences = m - n
        p_value = 1.0 if not np.any(differences) else float(stats.wilcoxon(differences).pvalue)
        figures.update({f"{prefix}_naive": _pgr(n, f, o), f"{prefix}_gain_over_naive": point - _pgr(n, f, o),
                        f"{prefix}_gain_low": gain_low, f"{prefix}_gain_high": gain_high,
                        f"{prefix}_gain_p_value": p_value})
    return figures


def _f1_by_trajectory(quality: pd.DataFrame) -> pd.Series:
    return quality.groupby("trajectory_id")["token_f1"].mean()


def pgr_figures(quality: pd.DataFrame, floor: pd.DataFrame, naive: pd.DataFrame | None = None,
                confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """`output_pgr`: PGR over token F1 against the reference (the oracle's own score: 1) of a run
    against its floor (both compared with the same reference), optionally against naive reuse."""
    return pgr_from_scores(_f1_by_trajectory(quality), _f1_by_trajectory(floor), None,
                           _f1_by_trajectory(naive) if naive is not None else None, OUTPUT_PGR, confidence, seed)


def _task_by_trajectory(run_dir: Path) -> pd.Series | None:
    """Whether each trajectory's final answer was right (a task trace's score), or None."""
    path = run_dir / run_files.TASK_SCORES
    if not path.exists():
        return None
    scores = pd.read_parquet(path)
    final = scores[scores["final"]]
    return final.groupby("trajectory_id")["correct"].mean().astype(float) if len(final) else None


def write_quality(result_dir: Path, reference_dir: Path, floor_dir: Path | None = None,
                  naive_dir: Path | None = None) -> pd.DataFrame:
    """Compare the run in `result_dir` with the reference run into `quality.parquet`; with a
    floor run, also its PGR (`quality_pgr.json`): over token F1, and over the task's score where
    the trace has a task and all runs were scored; with a naive-reuse run (FullShared), the gain
    over it. The summary picks both up."""
    reference = _read_requests(reference_dir)
    config = result_dir / run_files.CONFIG
    first_token_only = config.exists() and json.loads(config.read_text()).get("protocol") == "paper"
    quality = compare_outputs(_read_requests(result_dir), reference, first_token_only)
    quality.to_parquet(result_dir / run_files.QUALITY, index=False)
    pgr_path = result_dir / run_files.QUALITY_PGR
    if floor_dir is not None:
        floor = compare_outputs(_read_requests(floor_dir), reference)
        naive = compare_outputs(_read_requests(naive_dir), reference) if naive_dir is not None else None
        figures = {**pgr_figures(quality, floor, naive), "pgr_schema": PGR_SCHEMA, "reference_run": str(reference_dir),
                   "floor_run": str(floor_dir), "naive_run": str(naive_dir) if naive_dir else None}
        task = {name: _task_by_trajectory(d) for name, d in
                (("method", result_dir), ("floor", floor_dir), ("oracle", reference_dir))}
        naive_task = _task_by_trajectory(naive_dir) if naive_dir is not None else None
        if all(v is not None for v in task.values()):
            figures.update(pgr_from_scores(task["method"], task["floor"], task["oracle"],  # type: ignore[arg-type]
                                           naive_task, prefix=TASK_PGR))
        # JSON has no NaN: an undefined PGR is null, beside its reason
        figures = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in figures.items()}
        pgr_path.write_text(json.dumps(figures, indent=2) + "\n")
    elif pgr_path.exists():
        pgr_path.unlink()  # from another floor: stale
    return quality


def reference_has_logprobs(reference_dir: Path) -> bool:
    """Whether a reference run recorded first-token logprobs (what first-token KL needs)."""
    requests = _read_requests(reference_dir)
    return "first_token_logprobs" in requests and bool(requests["first_token_logprobs"].notna().any())


def _read_requests(run_dir: Path) -> pd.DataFrame:
    """The columns a comparison reads (runs recorded before first-token logprobs lack that one),
    from the journal where requests.parquet falls short of it (run_files.load_requests)."""
    requests = run_files.load_requests(run_dir, rebuild=False).frame
    return requests[[c for c in READ_COLUMNS if c in requests.columns]]


def renamed_pgr_keys(figures: dict[str, Any]) -> dict[str, Any]:
    """Figures (quality_pgr.json, or a summary holding them) written before the names changed (no
    pgr_schema): their `pgr*` keys were over token F1 (now `output_pgr*`) and their `pgr_task*`
    keys over the task (now `pgr*`). Anything else passes unchanged."""
    if figures.get("pgr_schema") == PGR_SCHEMA or not any(k.startswith("pgr") for k in figures):
        return figures
    out = {}
    for key, value in figures.items():
        if key.startswith("pgr_task"):
            key = TASK_PGR + key[len("pgr_task"):]
        elif key.startswith("pgr"):
            key = OUTPUT_PGR + key[len("pgr"):]
        out[key] = value
    return {**out, "pgr_schema": PGR_SCHEMA}


def read_quality_figures(result_dir: Path) -> dict[str, Any]:
    path = result_dir / run_files.QUALITY
    figures = quality_figures(pd.read_parquet(path)) if path.exists() else {}
    pgr_path = result_dir / run_files.QUALITY_PGR
    if pgr_path.exists():
        figures.update(renamed_pgr_keys(json.loads(pgr_path.read_text())))
    return figures
