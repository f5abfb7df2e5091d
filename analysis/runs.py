"""Loading recorded runs (the output of `kvbench replay`) for analysis."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd


class RunLoadError(ValueError):
    """A directory is not a readable kvbench run."""


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    requests: pd.DataFrame

    @property
    def name(self) -> str:
        return self.summary.get("label") or self.summary.get("method") or self.path.name

    @property
    def method(self) -> str:
        return str(self.summary.get("method"))

    @property
    def config(self) -> dict[str, Any]:
        return self.summary.get("config", {})

    def memory(self) -> dict[str, float]:
        """The three memory figures of a run, kept apart (vLLM pre-allocates its KV pool)."""
        state = self.summary.get("method_state_bytes") or {}
        # Methods report current bytes and their peaks ("peak_<name>"): count peaks when given.
        peaks = {k[len("peak_"):]: v for k, v in state.items() if k.startswith("peak_")}
        state_bytes = sum({**{k: v for k, v in state.items() if not k.startswith("peak_")}, **peaks}.values())
        rss = self.summary.get("peak_server_rss_bytes")
        usage = self.summary.get("peak_kv_cache_usage_perc")
        evictions = self.summary.get("store_evictions")
        return {
            "method_state_mib": ((self.summary.get("method_store_peak_bytes") or 0) + state_bytes) / 2**20,
            "store_peak_mib": (self.summary.get("method_store_peak_bytes") or 0) / 2**20,
            "store_evictions": evictions if evictions is not None else math.nan,
            "peak_server_rss_mib": rss / 2**20 if rss else math.nan,
            "peak_kv_cache_usage_perc": 100 * usage if usage is not None else math.nan,
        }

    @property
    def shared_tokens(self) -> int | None:
        return self.config.get("trace_header", {}).get("generator", {}).get("shared_tokens")


def load_run(path: Path) -> Run:
    summary_path, requests_path = path / "summary.json", path / "requests.parquet"
    if not summary_path.exists() or not requests_path.exists():
        raise RunLoadError(f"{path} is not a kvbench run (needs summary.json and requests.parquet)")
    try:
        summary = json.loads(summary_path.read_text())
        requests = pd.read_parquet(requests_path)
    except (json.JSONDecodeError, OSError, ValueError) as exc:
        raise RunLoadError(f"cannot read the run in {path}: {exc}") from None
    return Run(path, summary, requests)


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
    return runs
