"""The files of a run directory: what `kvbench replay` writes and `kvbench.analysis` reads.

Data flows one way (trace -> replay -> results -> analysis); these names are the only thing the
two sides share. Documented column by column in docs/results.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CONFIG = "config.json"  # how the run was made; one entry per segment (a resumed run has several)
REQUESTS_JOURNAL = "requests.jsonl"  # one record per finished request, appended as it finishes
REQUESTS = "requests.parquet"  # the same records, snapshotted atomically
METHOD_STATS = "method_stats.jsonl"  # the connector's answers: per-request stats and store state
SERVER_METRICS = "server_metrics.jsonl"  # /metrics and process memory samples
TASK_SCORES = "task_scores.parquet"  # a task trace's turns against their gold answers (analysis)
QUALITY = "quality.parquet"  # each turn's output against a reference run's (analysis)
QUALITY_PGR = "quality_pgr.json"  # PGR against a no-shared-context floor run (analysis)
SUMMARY = "summary.json"  # written by analysis from the files above
FLOOR_LABEL = "no-context"  # the name of a `replay --drop-shared` run (PGR's floor) in reports


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The entries of an append-only journal (empty if it does not exist). A line that is not a
    JSON object is skipped: the writer died mid-line (a torn last line), and what it would have
    said counts as missing."""
    if not path.exists():
        return []
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, path: Path) -> None:
    """Rename a written temp file over `path`, its data and the rename on disk before returning."""
    _fsync_path(tmp)
    os.replace(tmp, path)
    _fsync_path(path.parent)  # the rename itself is a change to the folder


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` whole (temp file + rename): a reader or a crash never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    replace_durably(tmp, path)
