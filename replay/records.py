"""Per-request records on disk: an append-only journal, and requests.parquet snapshotted from it.

A crash (of the client or the server) never loses a finished request: every record is appended
and flushed to `requests.jsonl` when it completes, and fsynced at most JOURNAL_FSYNC_S later (so a
power loss or a kernel crash loses at most that much; a killed process loses nothing flushed).
Every rewrite (the journal on resume, `requests.parquet` every few seconds and at the end, the
config) is atomic: temp file, fsync, rename, fsync of the folder, so it is always readable whole.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from kvbench import run_files
from kvbench.run_files import replace_durably, write_text_atomic

if TYPE_CHECKING:
    from kvbench.replay.backend import CompletionResult


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


SCHEMA = pa.schema([
    ("run_id", pa.string()), ("method", pa.string()), ("trajectory_id", pa.string()), ("turn_id", pa.string()),
    ("agent", pa.string()), ("edge_source", pa.string()), ("server_url", pa.string()), ("request_id", pa.string()),
    ("prompt_tokens", pa.int64()), ("shared_tokens", pa.int64()), ("reusable_tokens", pa.int64()),
    ("scheduled_ns", pa.int64()), ("sent_ns", pa.int64()), ("first_token_ns", pa.int64()), ("end_ns", pa.int64()),
    ("client_queue_ms", pa.float64()), ("ttft_ms", pa.float64()), ("tpot_ms", pa.float64()),
    ("e2el_ms", pa.float64()), ("itl_ms", pa.list_(pa.float64())), ("output_tokens", pa.int64()),
    ("cached_tokens", pa.int64()), ("prefix_cached_tokens", pa.int64()), ("eligible_tokens", pa.int64()),
    ("reused_tokens", pa.int64()),
    ("recomputed_tokens", pa.int64()),
    ("source_missing_tokens", pa.int64()),
    ("method_stats", pa.string()), ("success", pa.bool_()), ("error_type", pa.string()),
    ("error_message", pa.string()), ("output_token_ids", pa.list_(pa.int64())),
    ("prompt_token_ids", pa.list_(pa.int64())), ("first_token_logprobs", pa.string()),
])


def read_journal(result_dir: Path) -> list[dict[str, Any]]:
    """Records of an earlier (possibly interrupted) run; a torn last line is ignored."""
    return run_files.read_jsonl(result_dir / run_files.REQUESTS_JOURNAL)  # a torn request re-runs on --resume


JOURNAL_FSYNC_S = 1.0  # the longest a flushed journal record waits for fsync


def write_parquet(records: list[dict[str, Any]], path: Path) -> None:
    table = pa.Table.from_pylist(records, schema=SCHEMA)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    replace_durably(tmp, path)


class ResultsWriter:
    """Appends records to the journal as they finish and snapshots them to Parquet."""

    def __init__(self, result_dir: Path, existing: list[dict[str, Any]] | None = None,
                 snapshot_every_s: float = 5.0) -> None:
        self.result_dir = result_dir
        self.records: list[dict[str, Any]] = list(existing or [])
        self.snapshot_every_s = snapshot_every_s
        self._last_snapshot = time.monotonic()
        result_dir.mkdir(parents=True, exist_ok=True)
        # Rewrite the journal so that records dropped for a resume are gone from it too; atomically,
        # since the records kept are an earlier run's only copy.
        journal = result_dir / run_files.REQUESTS_JOURNAL
        write_text_atomic(journal, "".join(json.dumps(r) + "\n" for r in self.records))
        self._journal = open(journal, "a", encoding="utf-8")
        self._last_fsync = time.monotonic()
        self.snapshot()

    def add(self, record: RequestRecord) -> None:
        row = asdict(record)
        self.records.append(row)
        self._journal.write(json.dumps(row) + "\n")
        self._journal.flush()
        if time.monotonic() - self._last_fsync >= JOURNAL_FSYNC_S:
            self.sync()
        if time.monotonic() - self._last_snapshot >= self.snapshot_every_s:
            self.snapshot()

    def rewrite(self) -> None:
        """Rewrite journal and Parquet after records were updated in place (method stats)."""
        self._journal.close()
        journal = self.result_dir / run_files.REQUESTS_JOURNAL
        write_text_atomic(journal, "".join(json.dumps(r) + "\n" for r in self.records))
        self._journal = open(journal, "a", encoding="utf-8")
        self.snapshot()

    def sync(self) -> None:
        """The journal's flushed records on disk (fsync)."""
        os.fsync(self._journal.fileno())
        self._last_fsync = time.monotonic()

    def snapshot(self) -> None:
        write_parquet(self.records, self.result_dir / run_files.REQUESTS)
        self._last_snapshot = time.monotonic()

    def close(self) -> None:
        if not self._journal.closed:
            self.sync()
            self.snapshot()
            self._journal.close()
