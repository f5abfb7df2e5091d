"""Where a turn's time goes: the connector's per-request timings of recorded runs, step by step.

Every load reports how long each of its steps took (kvbench.contracts.LoadStats and the delta
methods' per-segment decisions); this module turns a run's records into one row per run and turn
kind (the turns that reuse, and those vLLM prefilled itself) with the median of each step, beside
the client's TTFT. It reads recorded files only, so it profiles any run after the fact, and two
profiles of the same workload show which step a change made slower (`kvbench profile`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from kvbench.analysis.runs import Run

Stats = dict[str, Any]


def _decisions_sum(name: str) -> Callable[[Stats], float]:
    return lambda stats: float(sum(d.get(name, 0.0) for d in stats.get("decisions", [])))


def _first_offset(stats: Stats) -> float:
    offsets = stats.get("load_step_offsets_s") or []
    return float(offsets[0]) if offsets else float("nan")


# (column, what it is, how to read it from one request's stats), in the order a load runs them.
STEPS: list[tuple[str, str, Callable[[Stats], float]]] = [
    ("queued_ms", "from the load's creation to its first engine step (behind other loads)", _first_offset),
    ("store_decode_ms", "decoding compressed source entries (PolyKV)", lambda s: s.get("store_decode_s", 0.0)),
    ("reference_prefill_ms", "context-free reference prefills (non-chained methods)",
     lambda s: s.get("reference_prefill_s", 0.0)),
    ("source_rows_ms", "rebuilding source rows for matching", _decisions_sum("rows_s")),
    ("gate_ms", "anchor distances and the entropy gate", _decisions_sum("gate_s")),
    ("interpolate_ms", "token-weighted interpolation of anchor deltas", _decisions_sum("interpolate_s")),
    ("decide_ms", "every segment's decision (includes the three above)", _decisions_sum("decide_s")),
    ("forward_ms", "placement and partial forward over every layer (includes the four below)",
     lambda s: s.get("materialize_s", float("nan"))),
    ("placement_ms", "building the reused rows every layer: gather, RoPE, correction, finiteness check "
     "(includes the two below)", lambda s: s.get("placement_s", float("nan"))),
    ("rope_ms", "re-rotating reused keys to their new positions", lambda s: s.get("rope_s", float("nan"))),
    ("correction_ms", "low-rank reconstruction and adding the deltas, inside the layers", _decisions_sum("apply_s")),
    ("attention_ms", "attention of the computed rows over the paged cache", lambda s: s.get("attention_s", 0.0)),
    ("load_ms", "the whole load, first step to last (waits between steps included)",
     lambda s: s.get("load_s", float("nan"))),
    ("save_ms", "copying the finished request into the store (after its last token)",
     lambda s: s.get("save_s", float("nan"))),
]


def profile_rows(run: Run) -> list[dict[str, Any]]:
    """One row per turn kind of `run`: how many turns, their p50 TTFT (client) and the median of
    each connector step (ms) over those of them the connector reported."""
    requests = run.requests[run.requests["success"]]
    if "method_stats" not in requests:
        return []
    stats = requests["method_stats"].map(lambda s: json.loads(s) if isinstance(s, str) and s else {})
    claimed = stats.map(lambda s: bool(s) and s.get("claimed", True) and "reused_tokens" in s)
    name = run.name if run.path.name == run.name else f"{run.name} {run.path.name}"  # a sweep cell: its point
    rows = []
    for kind, mask in (("reuse turns", requests["reusable_tokens"] > 0),
                       ("turns reusing nothing", requests["reusable_tokens"] == 0)):
        if not mask.any():
            continue
        kind_stats = stats[mask]
        row: dict[str, Any] = {"run": name, "method": run.method, "turns": kind,
                               "requests": int(mask.sum()), "claimed": int(claimed[mask].sum()),
                               "p50_ttft_ms": float(requests.loc[mask, "ttft_ms"].median())}
        loaded = kind_stats[claimed[mask]]
        for column, _, read in STEPS:
            source = kind_stats if column == "save_ms" else loaded  # every saved request has a save time
            values = [read(s) for s in source if s]
            values = [v for v in values if not np.isnan(v)]
            row[column] = float(np.median(values) * 1e3) if values else float("nan")
        rows.append(row)
    return rows


def profile_table(runs: list[Run]) -> pd.DataFrame:
    return pd.DataFrame([row for run in runs for row in profile_rows(run)])


def legend() -> str:
    """What each step column measures (for the report under the table)."""
    return "\n".join(f"- `{column}`: {what}" for column, what, _ in STEPS) + (
        "\n\nNot in the table: anchor building and prematching run after the first token (`run_deferred`, "
        "outside TTFT); the stats RPCs run between engine steps, every few seconds.")
