"""Loading recorded runs (the output of `kvbench replay`) for analysis."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import run_files
from kvbench.tracegen.tasks.registry import all_tasks


class RunLoadError(ValueError):
    """A directory is not a readable kvbench run."""


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    requests: pd.DataFrame
    # When another comparison in the same report holds the same cell: when its comparison started
    # (find_runs), so that two quickstarts' rows are told apart and never taken for repeats.
    tag: str = ""

    @property
    def name(self) -> str:
        """The run's name in tables: its label, else `no-context` for PGR's floor (a NonShared
        replay without the shared context), else its method."""
        return (self.summary.get("label") or (run_files.FLOOR_LABEL if self.is_floor else None) or self.summary.get("method")
                or self.path.name)

    @property
    def saturated(self) -> bool:
        """The run stopped over-saturated (kvbench.replay.saturation): its figures describe a
        growing queue, not a steady state."""
        return self.summary.get("saturated") is True

    @property
    def is_floor(self) -> bool:
        """PGR's no-context floor (`replay --drop-shared`): its own kind of run, not a method's."""
        return self.config.get("prompt_mode") == "drop_shared"

    @property
    def method(self) -> str:
        return str(self.summary.get("method"))

    @property
    def config(self) -> dict[str, Any]:
        return self.summary.get("config", {})

    @property
    def model_name(self) -> str:
        """The model as kvbench names it: `kvbench:<name>` for embedded models, else as given."""
        identity = self.config.get("model_identity") or self.config.get("model") or "?"
        return str(identity).split("@", 1)[0]

    def memory(self) -> dict[str, float]:
        """A run's memory figures (metric_catalog), kept apart (vLLM pre-allocates its KV pool)."""
        state = self.summary.get("method_state_bytes") or {}
        # Methods report current bytes and their peaks ("peak_<name>"): count peaks when given.
        peaks = {k[len("peak_"):]: v for k, v in state.items() if k.startswith("peak_")}
        state_bytes = sum({**{k: v for k, v in state.items() if not k.startswith("peak_")}, **peaks}.values())
        rss = self.summary.get("peak_server_rss_bytes")
        usage = self.summary.get("peak_kv_cache_usage_perc")
        evictions, refused = self.summary.get("store_evictions"), self.summary.get("store_refused")
        return {
            "method_state_mib": ((self.summary.get("method_store_peak_bytes") or 0) + state_bytes) / 2**20,
            "store_peak_mib": (self.summary.get("method_store_peak_bytes") or 0) / 2**20,
            "store_evictions": evictions if evictions is not None else math.nan,
            "store_refused": refused if refused is not None else math.nan,
            "peak_server_rss_mib": rss / 2**20 if rss else math.nan,
            "peak_kv_cache_usage_perc": usage if usage is not None else math.nan,  # 0..1, as vLLM's gauge
        }

    @property
    def is_quality_baseline(self) -> bool:
        """A sweep's NonShared reference or no-context floor (`kvbench sweep --quality`): what the
        cells are compared with, not a cell of the grid."""
        return self.config.get("sweep_role") == "quality-baseline"

    @property
    def shared_tokens(self) -> int | None:
        return self.config.get("trace_header", {}).get("generator", {}).get("shared_tokens")

    @property
    def workload(self) -> str:
        """What the run replayed at which load: shared tokens, agents, rounds, workflow, QPS."""
        generator = self._generator()
        task = all_tasks().get(str(generator.get("task")))
        if task is not None and task.uses_items:  # the item's question is the context
            parts = [str(generator["task"])]
        else:
            parts = [f"{short}={generator[key]}" for key, short in (("shared_tokens", "ctx"), ("num_agents", "a"),
                                                                     ("rounds", "r")) if generator.get(key) is not None]
        if generator.get("workflow") not in (None, "sequential"):
            parts.append(str(generator["workflow"]))
        if self.summary.get("request_rate") is not None:
            parts.append(f"qps={self.summary['request_rate']:g}")
        return " ".join(parts)

    @property
    def comparison(self) -> str | None:
        """The id of the comparison this run is an arm of (`replay --method a,b,c`, the
        quickstart): a report pairs it only with runs of the same one. None: a run of its own."""
        return (self.config.get(run_files.COMPARISON) or {}).get("id")

    @property
    def interleaved(self) -> bool:
        """Its comparison's arms took turns a trajectory at a time (kvbench.replay.rotation)."""
        return bool((self.config.get(run_files.COMPARISON) or {}).get("interleaved"))

    @property
    def machine_loaded(self) -> bool:
        """Other processes used over a tenth of the machine's cores while it ran (replay/machine_load.py)."""
        return self.summary.get("machine_loaded") is True

    @property
    def others_cpu_share(self) -> float | None:
        """The share of the machine's cores other processes used while it ran (None: not recorded)."""
        value = self.summary.get("others_cpu_share")
        return float(value) if isinstance(value, int | float) else None

    @property
    def is_noise_floor(self) -> bool:
        """The A/A arm: NonShared replayed a second time in its comparison (what identical methods
        differ by on the machine), never the NonShared baseline itself."""
        return self.method == "nonshared" and self.summary.get("label") == run_files.AA_LABEL

    @property
    def cell(self) -> str:
        """The grid cell this run measured: its method configuration (label, else method) and its
        workload. Repeats of a cell share it."""
        return " ".join(filter(None, (self.name, self.workload, f"@{self.tag}" if self.tag else "")))

    @property
    def started(self) -> float | None:
        """When its first segment started (seconds since the epoch), if recorded."""
        segments = self.config.get("segments") or [{}]
        value = segments[0].get("started")
        return float(value) if isinstance(value, int | float) else None

    def _generator(self) -> dict[str, Any]:
        return (self.config.get("trace_header") or {}).get("generator") or {}

    def mismatch(self, other: Run) -> str | None:
        """Why this run's figures cannot be compared with `other`'s (another model, or the
        trajectories both ran differ in content), or None."""
        if self.config.get("model") != other.config.get("model"):
            return f"models differ ({self.config.get('model')} vs {other.config.get('model')})"
        ours, theirs = self.config.get("trajectory_digests"), other.config.get("trajectory_digests")
        if ours and theirs:
            differing = [t for t in set(ours) & set(theirs) if ours[t] != theirs[t]]
            if differing or not set(ours) & set(theirs):
                return "they replayed other traces (trajectory contents differ)"
            return None
        def content(run: Run) -> dict[str, Any]:  # the generator settings that change trajectories
            return {k: v for k, v in run._generator().items() if k not in ("num_trajectories", "qps", "kvbench_version")}

        return None if content(self) == content(other) else "their trace generator settings differ"


def referenced_runs(runs: list[Run]) -> set[Path]:
    """The runs other runs here were compared with (`kvbench quality --reference`): their outputs
    are the oracle, so their own PGR is 1 by definition."""
    return {Path(str(run.summary["reference_run"])).resolve() for run in runs if run.summary.get("reference_run")}


def summary_number(value: Any) -> float:
    """A summary value as a float: NaN where it is missing or not a number (bools are not)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def mean_summary(runs: list[Run], key: str) -> float:
    """The mean of a summary key over runs (a cell's repeats) that report it, else NaN."""
    values = [v for v in (summary_number(run.summary.get(key)) for run in runs) if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


# summary keys read as numbers (None where a run has no figure): checked when a run is loaded, so
# that a damaged summary.json is named with its key, not met as a TypeError deep in a table
_NUMBER_KEYS = re.compile(r"^(num_prompts|completed|failed|duration|request_rate|burstiness|max_concurrency|segments"
                          r"|completed_trajectories|failed_trajectories|store_evictions|store_refused|prefix_cache_\w+"
                          r"|num_preemptions|rank_mismatched_requests|method_stats_missing|task_\w+|\w*pgr\w*"
                          r"|\w+_(ms|tokens|throughput|rho|share|bytes|perc|rate|s))$")
_TYPED_KEYS: dict[str, type | tuple[type, ...]] = {
    "config": dict, "method_state_bytes": dict, "method": str, "label": str, "model_id": str,
    "method_stats_missing_requests": list, "segment_durations_s": list}


def summary_problems(summary: Any) -> list[str]:
    """What makes a summary.json unusable for tables: not an object, or a key of the wrong type."""
    if not isinstance(summary, dict):
        return [f"it holds a JSON {type(summary).__name__}, not an object"]
    problems = []
    for key, value in summary.items():
        if value is None:
            continue
        if key in _TYPED_KEYS:
            if not isinstance(value, _TYPED_KEYS[key]):
                expected = _TYPED_KEYS[key]
                problems.append(f"{key}: expected a {getattr(expected, '__name__', expected)}, got {type(value).__name__}")
        elif _NUMBER_KEYS.match(key) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            problems.append(f"{key}: expected a number, got {type(value).__name__} {str(value)[:40]!r}")
    return problems


def load_run(path: Path) -> Run:
    """A run's summary and requests (the journal where requests.parquet is missing, shorter or
    unreadable: run_files.load_requests, read only); RunLoadError naming what is wrong."""
    summary_path = path / run_files.SUMMARY
    if not summary_path.is_file():
        raise RunLoadError(f"{path} is not a kvbench run (no {run_files.SUMMARY} file)")
    try:
        from kvbench.analysis.quality import renamed_pgr_keys

        raw = json.loads(summary_path.read_text(encoding="utf-8"))
        if problems := summary_problems(raw):
            raise RunLoadError(f"cannot read the run in {path}: {run_files.SUMMARY}: " + "; ".join(problems[:5]))
        requests = run_files.answered_requests(run_files.load_requests(path, rebuild=False).frame)
    except RunLoadError:
        raise
    except (json.JSONDecodeError, OSError, ValueError) as exc:
        raise RunLoadError(f"cannot read the run in {path}: {exc}") from None
    return Run(path, renamed_pgr_keys(raw), requests)


def find_runs(paths: list[Path]) -> list[Run]:
    """Runs in the given directories: each is a run, or holds runs further down (sweeps)."""
    runs = []
    for path in paths:
        if (path / "summary.json").exists():
            runs.append(load_run(path))
            continue
        found = sorted({p.parent for p in path.rglob("summary.json")})
        if not found:
            raise RunLoadError(f"no kvbench runs in {path}")
        runs += [load_run(p) for p in found]
    tag_comparisons(runs)
    return runs


def tag_comparisons(runs: list[Run]) -> None:
    """Give the runs of a cell that several comparisons hold the time their comparison started
    (repeats inside one comparison or sweep keep one cell: they are repeats)."""
    from datetime import datetime

    by_cell: dict[str, set[str]] = {}
    for run in runs:
        if run.comparison is not None:
            by_cell.setdefault(run.cell, set()).add(run.comparison)
    starts: dict[str, float] = {}
    for run in runs:
        if run.comparison is not None and run.started is not None:
            starts[run.comparison] = min(starts.get(run.comparison, run.started), run.started)
    repeated = {cell for cell, ids in by_cell.items() if len(ids) > 1}
    for run in runs:
        if run.cell in repeated and run.comparison is not None:
            started = starts.get(run.comparison)
            run.tag = (datetime.fromtimestamp(started).strftime("%m-%d %H:%M:%S") if started is not None
                       else run.comparison)
