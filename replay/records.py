"""Per-request records on disk: an append-only journal, and requests.parquet snapshotted from it.

A crash (of the client or the server) never loses a finished request: every record is appended
and flushed to `requests.jsonl` when it completes, and fsynced at most JOURNAL_FSYNC_S later (so a
power loss or a kernel crash loses at most that much; a killed process loses nothing flushed).
The journal is never rewritten (a resume or the stats copied in at the end append control lines:
kvbench/run_files.py); every rewrite (`requests.parquet` every few seconds and at the end, the
config) is atomic: temp file, fsync, rename, fsync of the folder, so it is always readable whole,
and a write that fails leaves no temp file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbench import run_files

if TYPE_CHECKING:
    from kvbench.replay.backend import CompletionResult

logger = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    """One request. Times are monotonic nanoseconds since the run started; latencies in ms."""

    run_id: str
    method: str
    trajectory_id: str
    turn_id: str
    agent: str
    edge_source: str | None  # the turns this one waited for, comma-separated
    server_url: str
    request_id: str
    prompt_tokens: int
    shared_tokens: int  # PH tokens in the prompt
    reusable_tokens: int  # PH rows some earlier cache holds with K/V: what a perfect reuse serves
    scheduled_ns: int  # arrival (first turns) or when the last dependency finished
    sent_ns: int | None = None
    first_token_ns: int | None = None
    end_ns: int | None = None
    client_queue_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None  # vLLM's usage figure: its prefix cache plus every token a connector claimed
    # rows served as a dense prefill computes them, without computing: vLLM's own prefix cache, and
    # under a connector method also rows copied from an earlier cache's exact prefix
    prefix_cached_tokens: int | None = None
    eligible_tokens: int | None = None  # method-reported: PH tokens it could have served from a cache
    reused_tokens: int | None = None  # method-reported
    recomputed_tokens: int | None = None  # method-reported
    source_missing_tokens: int | None = None  # method-reported: reusable rows whose source the store had dropped
    method_stats: str | None = None  # JSON from the connector
    success: bool = False
    error_type: str | None = None
    error_message: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    generated_text: str | None = None  # the output decoded (vLLM bench's `generated_text`), to read a run's outputs
    prompt_token_ids: list[int] | None = None  # only with --save-prompt-ids
    first_token_logprobs: str | None = None  # JSON {"token_id:N": logprob}: top-K of the first token (--logprobs)

    def take_result(self, result: CompletionResult, t0_ns: int, queued_ns: int, output_ids: list[int]) -> None:
        """Times (against the run's start `t0_ns`; `queued_ns`: when the request waited for a
        concurrency slot), usage, outcome and, on success, the output `output_ids` of one answer."""
        self.client_queue_ms = (result.sent_ns - queued_ns) / 1e6
        self.sent_ns = result.sent_ns - t0_ns
        self.end_ns = (result.end_ns or result.sent_ns) - t0_ns
        self.error_type, self.error_message = result.error_type, result.error_message
        if result.usage:
            self.cached_tokens = (result.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if not result.success:
            return
        self.success = True
        self.first_token_ns = (result.first_token_ns or 0) - t0_ns
        self.ttft_ms = ((result.first_token_ns or 0) - result.sent_ns) / 1e6
        self.e2el_ms = ((result.end_ns or 0) - result.sent_ns) / 1e6
        self.output_tokens = int((result.usage or {}).get("completion_tokens") or len(output_ids))
        if self.output_tokens > 1:
            self.tpot_ms = (self.e2el_ms - self.ttft_ms) / (self.output_tokens - 1)
        self.itl_ms = [(b - a) / 1e6 for a, b in zip(result.chunk_ns, result.chunk_ns[1:])]
        self.output_token_ids = list(output_ids)
        if result.first_token_logprobs is not None:
            self.first_token_logprobs = json.dumps(result.first_token_logprobs)


def read_journal(result_dir: Path) -> list[dict[str, Any]]:
    """Records of an earlier (possibly interrupted) run; a torn last line is ignored."""
    return run_files.read_requests_journal(result_dir / run_files.REQUESTS_JOURNAL)  # a torn request re-runs on --resume


JOURNAL_FSYNC_S = 1.0  # the longest a flushed journal record waits for fsync


def _ends_torn(path: Path) -> bool:
    """Whether a non-empty file's last byte is not a newline."""
    with open(path, "rb") as handle:
        if not handle.seek(0, os.SEEK_END):
            return False
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) != b"\n"


class ResultsWriter:
    """Appends records to the journal as they finish and snapshots them to Parquet.

    The journal is only ever appended to (run_files: a resumed run appends a `drop` line for the
    trajectories it re-runs, the end of a segment `update` lines for the stats it copied in), so
    finishing a run needs no more free space than the lines it adds. The first journal write that
    fails (a full disk) is kept in `failure` and the writer stops writing; what it wrote stays
    whole. A Parquet snapshot that fails is only skipped."""

    def __init__(self, result_dir: Path, kept: list[dict[str, Any]] | None = None,
                 dropped_trajectories: list[str] | None = None, snapshot_every_s: float = 5.0) -> None:
        self.result_dir = result_dir
        self.records: list[dict[str, Any]] = list(kept or [])
        self.snapshot_every_s = snapshot_every_s
        self.failure: OSError | None = None  # a journal write failed: nothing more is recorded
        self.snapshot_failed = False
        self._last_snapshot = time.monotonic()
        result_dir.mkdir(parents=True, exist_ok=True)
        journal = result_dir / run_files.REQUESTS_JOURNAL
        self._fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._last_fsync = time.monotonic()
        if _ends_torn(journal):
            self._append(b"\n")  # a torn last line (the writer died mid-line) ends here, apart from what follows
        if dropped_trajectories:
            self._append(run_files.journal_line({run_files.JOURNAL_CONTROL: "drop",
                                                 "trajectory_ids": sorted(dropped_trajectories)}))
        self.snapshot()

    def _append(self, data: bytes) -> None:
        if self.failure is not None:
            raise self.failure
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            self.failure = exc
            raise

    def add(self, record: RequestRecord) -> None:
        row = asdict(record)
        self._append(run_files.journal_line(row))  # first on disk, then counted
        self.records.append(row)
        if time.monotonic() - self._last_fsync >= JOURNAL_FSYNC_S:
            self.sync()
        if time.monotonic() - self._last_snapshot >= self.snapshot_every_s:
            self.snapshot()

    def update(self, records: list[dict[str, Any]], fields: tuple[str, ...]) -> None:
        """Journal new values of `fields` of records already journaled (updated in place)."""
        self._append(b"".join(run_files.journal_line({run_files.JOURNAL_CONTROL: "update", "request_id": r["request_id"],
                                                      "fields": {f: r.get(f) for f in fields}}) for r in records))
        self.snapshot()

    def sync(self) -> None:
        """The journal's records on disk (fsync)."""
        if self.failure is None:
            os.fsync(self._fd)
        self._last_fsync = time.monotonic()

    def snapshot(self) -> None:
        """requests.parquet from the records so far. A snapshot that cannot be written (it needs
        its whole size free) is skipped with a warning, not the run's end: the journal holds
        every record, and readers rebuild the table from it (run_files.load_requests)."""
        self._last_snapshot = time.monotonic()
        if self.failure is not None:
            return
        try:
            run_files.write_requests_parquet(self.records, self.result_dir / run_files.REQUESTS)
        except OSError as exc:
            if not self.snapshot_failed:
                logger.warning("requests.parquet not updated (%s); requests.jsonl holds every record",
                               exc.strerror or exc)
            self.snapshot_failed = True

    def close(self) -> None:
        """The last snapshot, then the journal closed; raises the writer's failure, if any."""
        if self._fd < 0:
            return
        try:
            if self.failure is None:
                self.sync()
                self.snapshot()
        finally:
            os.close(self._fd)
            self._fd = -1
        if self.failure is not None:
            raise self.failure


def write_failure(folder: Path, exc: OSError, recorded: list[dict[str, Any]]) -> str:
    """What a failed write means for a run, in one line: the folder, the error, what is safe."""
    return (f"cannot write to {folder} ({exc.strerror or exc}); the {len(recorded)} requests recorded before it "
            f"are safe in {run_files.REQUESTS_JOURNAL}: free space, then rerun it with --resume (it replays the "
            f"trajectories not finished, and those whose method stats were lost), or `kvbench summarize {folder}` for "
            "what was recorded (it counts the requests without method stats: method_stats_missing)")
