"""KV error of a sweep's cells against dense prefills, measured while each cell's server is up
(its saved caches live there) and kept beside the cell's results."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from kvbench import run_files
from kvbench.experiment.sweep import AfterCell, SweepCell

KV_ERROR_FILE = "kv_error.json"


def record_kv_errors(trajectories: int) -> AfterCell:
    """An `after_cell` hook: for each single-stream cell of a method other than NonShared (the
    dense reference itself), the mean KV error over the last `trajectories` measured
    trajectories (`replay.kv_error.mean_kv_errors`) into the cell's kv_error.json."""
    def after_cell(cell: SweepCell, server: Any, summary: dict[str, Any]) -> None:
        from kvbench.replay.kv_error import mean_kv_errors

        if cell.qps == 0 and cell.method.method != "nonshared":
            requests = pd.read_parquet(cell.path / run_files.REQUESTS)
            errors = mean_kv_errors(server.base_url, server.config.model, requests, trajectories)
            (cell.path / KV_ERROR_FILE).write_text(json.dumps(errors))
    return after_cell


def read_kv_errors(cell: SweepCell) -> dict[str, Any] | None:
    """What `record_kv_errors` kept for the cell, or None."""
    path = cell.path / KV_ERROR_FILE
    return json.loads(path.read_text()) if path.exists() else None
