"""Goodput: the rate of requests and of whole workflows that meet every latency bound given
(`--goodput ttft:200 e2el:5000 workflow:20000`, in ms, as `vllm bench serve --goodput`).

A request is good when each request-level bound holds for it (TTFT, TPOT, E2EL); a workflow (a
trajectory) when all its turns succeeded, all are good and its makespan, from its first arrival
to its last agent's last token, meets the `workflow` bound. A failed request is never good.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pandas as pd

REQUEST_BOUNDS = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys
WORKFLOW_BOUND = "workflow"
GOODPUT_KEYS = (*REQUEST_BOUNDS, WORKFLOW_BOUND)


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """`KEY:MS` items (several per item, space-separated, as vLLM's flag takes them) into bounds;
    ValueError naming the bad one."""
    bounds: dict[str, float] = {}
    for item in (part for spec in specs for part in spec.split()):
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}, got {item!r}")
        try:
            bound = float(value)
        except ValueError:
            bound = math.nan
        if not math.isfinite(bound) or bound <= 0:
            raise ValueError(f"--goodput {key}: expected a positive number of milliseconds, got {value!r}")
        bounds[key] = bound
    return bounds


def good_requests(requests: pd.DataFrame, bounds: dict[str, float]) -> pd.Series:
    """Whether each request succeeded and met every request-level bound (index-aligned)."""
    good = requests["success"].astype(bool).copy()
    for key in REQUEST_BOUNDS:
        if key in bounds:
            # TPOT is undefined for one output token: vLLM counts such a request as meeting it
            values = requests[f"{key}_ms"].astype(float)
            good &= values.le(bounds[key]) | (values.isna() & (key == "tpot"))
    return good


def goodput_figures(requests: pd.DataFrame, makespans: pd.Series, duration_s: float,
                    bounds: dict[str, float]) -> dict[str, Any]:
    """`request_goodput` (good requests per second, vLLM's key), `workflow_goodput` (good
    workflows per second) and the good shares of all requests and workflows. `makespans`: ms per
    trajectory id, of the trajectories whose turns all succeeded."""
    if not bounds:
        return {"goodput_slo": None, "request_goodput": None, "request_goodput_share": None,
                "workflow_goodput": None, "workflow_goodput_share": None}
    good = good_requests(requests, bounds) if len(requests) else pd.Series(dtype=bool)
    trajectories = requests["trajectory_id"].nunique() if len(requests) else 0
    good_turns = good.groupby(requests["trajectory_id"]).all() if len(requests) else pd.Series(dtype=bool)
    good_workflows = good_turns[good_turns].index.intersection(makespans.index)
    if WORKFLOW_BOUND in bounds:
        good_workflows = good_workflows[makespans.loc[good_workflows].to_numpy() <= bounds[WORKFLOW_BOUND]]
    duration_s = max(duration_s, 1e-9)
    return {"goodput_slo": dict(bounds),
            "request_goodput": float(good.sum()) / duration_s,
            "request_goodput_share": float(good.mean()) if len(good) else None,
            "workflow_goodput": len(good_workflows) / duration_s,
            "workflow_goodput_share": len(good_workflows) / trajectories if trajectories else None}
