"""Loading recorded runs (the output of `kvbench replay`) for analysis."""

from __future__ import annotations

import json
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
