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

from kvbench import run_files
from kvbench.analysis.runs import Run

Stats = dict[str, Any]


def _decisions_sum(name: str) -> Callable[[Stats], float]:
    return lambda stats: float(sum(d.get(name, 0.0) for d in stats.get("decisions", [])))


def _first_offset(stats: Stats) -> float:
    offsets = stats.get("load_step_offsets_s") or []
    return float(offsets[0]) if offsets else float("nan")


# (column, what it is, how to read it from one request's stats), in the order a load runs them.
STEPS: list[tuple[str, str, Callable[[Stats], float]]] = [
    ("source_wait_ms", "held back by the scheduler until a source cache was saved (before the load exists)",
     lambda s: s.get("source_wait_s", float("nan"))),
    ("decide_wait_ms", "waiting for the method's decision, made one engine step before the claim (methods whose "
     "gate may send segments dense)", lambda s: s.get("decide_wait_s", float("nan"))),
    ("queued_ms", "from the load's creation to its first engine step (behind other loads)", _first_offset),
    ("shared_fetch_ms", "reading sources another instance saved from the shared tier (get and parse)",
     lambda s: s.get("shared_fetch_s", 0.0)),
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
    ("rows_delivery_ms", "reading rows the method observes (dense segments) after the forward that computed them, "
     "in the request's own step", lambda s: s.get("rows_delivery_s", float("nan"))),
    ("save_ms", "copying the finished request into the store (after its last token)",
     lambda s: s.get("save_s", float("nan"))),
]


UNLOADED_STEPS = {"decide_wait_ms", "rows_delivery_ms", "save_ms"}  # reported by requests vLLM prefilled too


def _label(run: Run) -> str:
    """The run's name in the tables; a sweep cell's adds its point (its folder)."""
    return run.name if run.path.name == run.name else f"{run.name} {run.path.name}"


def profile_rows(run: Run) -> list[dict[str, Any]]:
    """One row per turn kind of `run`: how many turns, their p50 TTFT (client) and the median of
    each connector step (ms) over those of them the connector reported."""
    requests = run.requests[run.requests["success"]]
    if "method_stats" not in requests:
        return []
    stats = requests["method_stats"].map(lambda s: json.loads(s) if isinstance(s, str) and s else {})
    claimed = stats.map(lambda s: bool(s) and s.get("claimed", True) and "reused_tokens" in s)
    name = _label(run)
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
            # every saved request has a save time; a decision sent wholly dense (vLLM's prefill) has
            # its wait and its observed rows' reading, not a load
            source = kind_stats if column in UNLOADED_STEPS else loaded
            values = [read(s) for s in source if s]
            values = [v for v in values if not np.isnan(v)]
            row[column] = float(np.median(values) * 1e3) if values else float("nan")
        rows.append(row)
    return rows


def profile_table(runs: list[Run]) -> pd.DataFrame:
    return pd.DataFrame([row for run in runs for row in profile_rows(run)])


def outside_turns_row(run: Run) -> dict[str, Any] | None:
    """Work of `run` that belongs to no turn but runs inside the engine's steps, from the last
    segment's method-stats journal: the method's deferred work (anchor building and prematching,
    after their request's first token; slowest rank, summed over servers) and the stats polls
    (round trip; the engine answers between two steps). None for a run that did not record them."""
    states = [e for e in run_files.read_jsonl(run.path / run_files.METHOD_STATS)
              if e.get("kind") == "state" and "deferred_s" in e]  # (runs recorded before kvbench measured it: none)
    if not states:
        return None
    segment = max(int(e.get("segment", 0)) for e in states)
    states = [e for e in states if int(e.get("segment", 0)) == segment]
    latest = {e["server_url"]: e for e in states}  # the journal is in time order
    deferred_s = sum(float(e.get("deferred_s", 0.0)) for e in latest.values())
    polls = [float(e["poll_s"]) for e in states if e.get("poll_s")]
    turns = int(run.requests["success"].sum())
    name = _label(run)
    return {"run": name, "method": run.method, "turns": turns, "deferred_ms": deferred_s * 1e3,
            "deferred_ms_per_turn": deferred_s * 1e3 / turns if turns else float("nan"),
            "stats_polls": len(polls), "p50_poll_ms": float(np.median(polls) * 1e3) if polls else float("nan")}


def outside_turns_table(runs: list[Run]) -> pd.DataFrame:
    return pd.DataFrame([row for run in runs if (row := outside_turns_row(run)) is not None])


def legend() -> str:
    """What each step column measures (for the report under the table)."""
    return "\n".join(f"- `{column}`: {what}" for column, what, _ in STEPS)


OUTSIDE_TURNS_LEGEND = (
    "- `deferred_ms`: the method's deferred work over the run (anchor building, prematching): after its "
    "request's first token, in a later engine step that other requests may share; `deferred_ms_per_turn` "
    "spreads it over the run's turns\n"
    "- `stats_polls`, `p50_poll_ms`: the replayer's polls of the connector's stats and their round trip "
    "(answered between two engine steps)")
