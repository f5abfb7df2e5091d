"""The files of a run directory: what `kvbench replay` writes and `kvbench.analysis` reads.

Data flows one way (trace -> replay -> results -> analysis); these names are the only thing the
two sides share. Documented column by column in docs/results.md.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG = "config.json"  # how the run was made; one entry per segment (a resumed run has several)
REQUESTS_JOURNAL = "requests.jsonl"  # one record per finished request, appended as it finishes
REQUESTS = "requests.parquet"  # the same records, snapshotted atomically
METHOD_STATS = "method_stats.jsonl"  # the connector's answers: per-request stats and store state
SERVER_METRICS = "server_metrics.jsonl"  # /metrics and process memory samples
MACHINE_LOAD = "machine_load.jsonl"  # what else the machine did meanwhile (replay/machine_load.py)
TASK_SCORES = "task_scores.parquet"  # a task trace's turns against their gold answers (analysis)
QUALITY = "quality.parquet"  # each turn's output against a reference run's (analysis)
QUALITY_PGR = "quality_pgr.json"  # PGR against a no-shared-context floor run (analysis)
SUMMARY = "summary.json"  # written by analysis from the files above
FIDELITY_SEGMENTS = "fidelity_segments.parquet"  # per (segment, layer), from a fidelity sweep's FullShared cell
FIDELITY_ERRORS = "fidelity_errors.parquet"  # per (segment, layer), from each method's cell of it
# error_type of a request in flight when an over-saturated run stopped: never answered, not a
# failure; analysis leaves such records out (`answered_requests`)
SATURATION_STOP = "saturated"
FLOOR_LABEL = "no-context"  # the name of a `replay --drop-shared` run (PGR's floor) in reports
# The noise floor's arm of a comparison: NonShared replayed a second time, taken in turn like the
# methods (kvbench.experiment.interleaved); its ratio to NonShared is what identical methods differ by.
AA_LABEL = "nonshared-aa"
COMPARISON = "comparison"  # config.json: {"id", "arms", "interleaved"} of the comparison a run is an arm of


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


def append_segment(path: Path, samples: list[dict[str, Any]], segment: int) -> None:
    """Append a segment's samples to a JSONL file, each tagged with the segment (a resumed run adds one)."""
    with open(path, "a") as handle:
        handle.write("".join(json.dumps({"segment": segment, **s}) + "\n" for s in samples))


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


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Replace `path` whole: `write` fills a temp file beside it (and may check it), which is then
    renamed over `path`; a reader or a crash never sees half of it, and a write or check that
    fails (a full disk, a refusal) leaves `path` as it was and no temp file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


# -- the requests journal ----------------------------------------------------------------------
# requests.jsonl is append-only and the source of truth: a line is a request's record, or a
# control line (a JSON object with the key JOURNAL_CONTROL) that a resumed run or the end of a
# segment appends instead of rewriting the file (which would need its size free again):
#   {"journal": "drop", "trajectory_ids": [...]}  the earlier records of these trajectories are
#                                                 void (a resumed run re-runs them whole)
#   {"journal": "update", "request_id": ID, "fields": {...}}  fields of the earlier record ID
JOURNAL_CONTROL = "journal"


def read_requests_journal(path: Path) -> list[dict[str, Any]]:
    """The journal's records in order, its control lines applied (a torn line is skipped)."""
    records: list[dict[str, Any]] = []
    by_id: dict[Any, dict[str, Any]] = {}
    for entry in read_jsonl(path):
        control = entry.get(JOURNAL_CONTROL)
        if control is None:
            records.append(entry)
            by_id[entry.get("request_id")] = entry
        elif control == "drop":
            dropped = set(entry.get("trajectory_ids") or ())
            records = [r for r in records if r.get("trajectory_id") not in dropped]
            by_id = {r.get("request_id"): r for r in records}
        elif control == "update" and (record := by_id.get(entry.get("request_id"))) is not None:
            record.update(entry.get("fields") or {})
    return records


def journal_line(entry: dict[str, Any]) -> bytes:
    return (json.dumps(entry) + "\n").encode("utf-8")


# -- requests.parquet ----------------------------------------------------------------------------
def requests_schema() -> Any:
    """requests.parquet's columns (docs/results.md), as pyarrow types."""
    import pyarrow as pa

    return pa.schema([
        ("run_id", pa.string()), ("method", pa.string()), ("trajectory_id", pa.string()), ("turn_id", pa.string()),
        ("agent", pa.string()), ("edge_source", pa.string()), ("server_url", pa.string()), ("request_id", pa.string()),
        ("prompt_tokens", pa.int64()), ("shared_tokens", pa.int64()), ("reusable_tokens", pa.int64()),
        ("scheduled_ns", pa.int64()), ("sent_ns", pa.int64()), ("first_token_ns", pa.int64()), ("end_ns", pa.int64()),
        ("client_queue_ms", pa.float64()), ("ttft_ms", pa.float64()), ("tpot_ms", pa.float64()),
        ("e2el_ms", pa.float64()), ("itl_ms", pa.list_(pa.float64())), ("output_tokens", pa.int64()),
        ("cached_tokens", pa.int64()), ("prefix_cached_tokens", pa.int64()), ("eligible_tokens", pa.int64()),
        ("reused_tokens", pa.int64()), ("recomputed_tokens", pa.int64()), ("source_missing_tokens", pa.int64()),
        ("method_stats", pa.string()), ("success", pa.bool_()), ("error_type", pa.string()),
        ("error_message", pa.string()), ("output_token_ids", pa.list_(pa.int64())),
        ("prompt_token_ids", pa.list_(pa.int64())), ("first_token_logprobs", pa.string()),
        ("generated_text", pa.string()),
    ])


def write_requests_parquet(records: list[dict[str, Any]], path: Path) -> None:
    """requests.parquet from records, atomically (no temp file left when the write fails)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(records, schema=requests_schema())
    write_atomic(path, lambda tmp: pq.write_table(table, tmp))


@dataclass(frozen=True)
class RequestsRead:
    """A run's request records and where they came from."""

    frame: Any  # pandas.DataFrame, columns as requests_schema()
    source: str  # "requests.parquet", or why the journal was read instead (and whether it was rebuilt)


def _parquet_rows(path: Path) -> tuple[Any, str | None]:
    """requests.parquet as a table, or None and why it cannot be used."""
    import pyarrow.parquet as pq

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None, "missing"
    if not stat.S_ISREG(mode):
        return None, "not a file"
    try:
        return pq.read_table(path), None
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        return None, f"unreadable: {str(exc).splitlines()[0][:120]}"


def load_requests(result_dir: Path, rebuild: bool = True) -> RequestsRead:
    """The run's request records. The journal is the source of truth: requests.parquet is used
    when it holds at least the journal's records, and otherwise (missing, shorter, not a file,
    unreadable) the journal is read and, with `rebuild`, requests.parquet rewritten from it
    (where it can be: a folder in its place, or a full disk, leaves it as it was).
    FileNotFoundError when neither exists: the run never reached its servers."""
    import pyarrow as pa

    parquet_path = result_dir / REQUESTS
    journal_path = result_dir / REQUESTS_JOURNAL
    table, problem = _parquet_rows(parquet_path)
    journal = read_requests_journal(journal_path) if journal_path.is_file() else None
    if journal is None or (table is not None and table.num_rows >= len(journal)):
        if table is None:
            raise FileNotFoundError(f"{result_dir} holds no {REQUESTS} ({problem}) and no {REQUESTS_JOURNAL}: "
                                    "not a run the replayer reached its servers in")
        return RequestsRead(table.to_pandas(), REQUESTS)
    why = problem or f"held {table.num_rows} of the journal's {len(journal)} records"
    frame = pa.Table.from_pylist(journal, schema=requests_schema()).to_pandas()
    if rebuild:
        try:
            if parquet_path.is_dir():
                raise IsADirectoryError(f"{parquet_path} is a directory")
            write_requests_parquet(journal, parquet_path)
            why += "; rebuilt from the journal"
        except OSError as exc:
            why += f"; not rewritten: {exc.strerror or exc}"
    return RequestsRead(frame, f"{REQUESTS_JOURNAL} ({REQUESTS}: {why})")


def answered_requests(frame: Any) -> Any:
    """A run's request records (a DataFrame) without those an over-saturated run stopped in flight."""
    if not len(frame) or "error_type" not in frame:
        return frame
    return frame[frame["error_type"] != SATURATION_STOP].reset_index(drop=True)
