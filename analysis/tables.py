"""Tables computed from recorded requests: latency, throughput, reuse, memory, failures."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from kvbench.analysis import metric_catalog
from kvbench.analysis.metrics import percentile_key, reuse_figures, trajectory_table
from kvbench.analysis.runs import Run, referenced_runs, summary_number

PERCENTILES = (50, 90, 99)
SATURATED_MARK = " [saturated]"  # after a run's name: it stopped over-saturated (kvbench.replay.saturation)
# What the speed cost: the quality view's figures a summary holds once compared or scored.
QUALITY_KEYS = [m.key for m in metric_catalog.in_view("quality") if m.source in ("reference", "task")]


def _pct(values: pd.Series, p: float) -> float:
    values = values.dropna()
    return float(np.percentile(values, p)) if len(values) else float("nan")


def method_table(runs: list[Run], percentiles: tuple[float, ...] = PERCENTILES) -> pd.DataFrame:
    """One row per run; every latency column has the run's failure counts beside it."""
    references = referenced_runs(runs)
    rows = []
    for run in runs:
        requests = run.requests
        ok = requests[requests["success"]]
        trajectories = trajectory_table(requests)
        row = {
            "run": run.cell + (SATURATED_MARK if run.saturated else ""),  # the full grid cell
            "method": run.method, "qps": run.summary.get("request_rate"),
            "shared_tokens": run.shared_tokens,
            "completed": int(len(ok)), "failed": int((~requests["success"]).sum()),
            "failed_trajectories": int(requests["trajectory_id"].nunique() - len(trajectories)),
        }
        for p in percentiles:
            row[f"{percentile_key(p)}_ttft_ms"] = _pct(ok["ttft_ms"], p)
        for p in percentiles:
            row[f"{percentile_key(p)}_trajectory_ttft_ms"] = _pct(trajectories["mean_ttft_ms"], p)
        row["mean_e2el_ms"] = float(ok["e2el_ms"].mean()) if len(ok) else float("nan")
        row["mean_trajectory_e2e_ms"] = float(trajectories["e2e_ms"].mean()) if len(trajectories) else float("nan")
        for p in percentiles:  # a workflow's makespan: first arrival to its last agent's last token
            row[f"{percentile_key(p)}_workflow_ms"] = _pct(trajectories["e2e_ms"], p)
        duration = summary_number(run.summary.get("duration"))
        row["workflow_throughput"] = len(trajectories) / duration if duration > 0 else float("nan")
        for key in ("request_goodput", "request_goodput_share", "workflow_goodput", "workflow_goodput_share"):
            row[key] = summary_number(run.summary.get(key))
        row["mean_trajectory_token_throughput"] = (float(trajectories["token_throughput"].mean())
                                              if len(trajectories) else float("nan"))
        for key in ("prefix_cache_hit_share", "reuse_share"):  # recorded in summaries since issue 51
            row[key] = summary_number(run.summary.get(key))
        reuse = reuse_figures(ok)
        for key in ("realized_rho", "eligible_rho", "reuse_lost_to_eviction_share", "reuse_lost_to_refusal_share"):
            row[key] = reuse[key] if reuse[key] is not None else float("nan")
        row.update(run.memory())
        for key in QUALITY_KEYS:  # what the speed cost (NaN: never compared or scored)
            row[key] = summary_number(run.summary.get(key))
        if run.path.resolve() in references:  # the oracle the others were compared with
            row.update({key: 1.0 for key in ("pgr", "pgr_low", "pgr_high", "output_pgr", "output_pgr_low",
                                             "output_pgr_high")})
        rows.append(row)
    return pd.DataFrame(rows)


def ttft_by_agent(runs: list[Run], percentile: float = 50) -> pd.DataFrame:
    """TTFT percentile by agent position (A0 first): where reuse starts paying off."""
    frames = []
    for run in runs:
        ok = run.requests[run.requests["success"]]
        by_agent = ok.groupby("agent")["ttft_ms"].quantile(percentile / 100).rename(run.cell)
        frames.append(by_agent)
    table = pd.concat(frames, axis=1) if frames else pd.DataFrame()
    return table.loc[agent_order(runs, list(table.index))] if len(table) else table


def agent_order(runs: list[Run], agents: list[str]) -> list[str]:
    """Agents in workflow order: kvbench's own (A0, A1, ...) by number, any other names (an imported
    log's `planner`, `coder`) by their first turn in the runs."""
    first_turn: dict[str, int] = {}
    for run in runs:
        requests = run.requests.sort_values("scheduled_ns") if "scheduled_ns" in run.requests else run.requests
        for position, agent in enumerate(requests["agent"].astype(str)):
            first_turn.setdefault(agent, position)

    def key(agent: str) -> tuple[int, int, str]:
        numbered = re.fullmatch(r"A(\d+)", agent)
        return (0, int(numbered.group(1)), "") if numbered else (1, first_turn.get(agent, 0), agent)
    return sorted(agents, key=key)
