"""One replay and its summary (and, for a task trace, its score)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench import run_files
from kvbench.analysis.quality import write_quality
from kvbench.analysis.summary import write_summary
from kvbench.analysis.task_score import write_scores
from kvbench.replay.runner import ReplayConfig, run_replay
from kvbench.tracegen.schema import Trace, TraceHeader, Trajectory
from kvbench.tracegen.tasks.registry import runs_model_code
from kvbench.tracegen.tasks.sandbox.code_execution import require_code_execution
from kvbench.tracegen.tokenizer import TraceTokenizer

logger = logging.getLogger(__name__)


def require_consent_for(trajectories: Sequence[Trajectory]) -> None:
    """A trace whose scoring runs model-written code (HumanEval) needs consent and a sandbox:
    refused before anything is replayed (CodeExecutionRefused)."""
    if runs_model_code({t.task.name for t in trajectories if t.task is not None}):
        require_code_execution()


def score_and_summarize(config: ReplayConfig) -> dict[str, Any]:
    """Score a recorded run of a task trace (and compare it with its reference, if any), then write
    `summary.json` and return it."""
    if any(t.task is not None for t in config.trace.trajectories):
        write_scores(config.output.result_dir, config.trace.trajectories, config.tokenizer)
    if config.quality.reference is not None:  # a reference-anchored run is compared with its reference
        write_quality(config.output.result_dir, config.quality.reference.path)
    return write_summary(config.output.result_dir)


def replay_and_summarize(config: ReplayConfig) -> dict[str, Any]:
    """Replay `config`, then write `summary.json` from what it recorded (scoring a task trace's
    outputs first) and return it. A run that was aborted or stopped by a signal is summarized
    too (the summary says which) before the error propagates; one that never reached its
    servers left nothing to summarize."""
    require_consent_for(config.trace.trajectories)
    try:
        run_replay(config)
    except BaseException:
        if (config.output.result_dir / run_files.REQUESTS_JOURNAL).exists():
            try:
                score_and_summarize(config)
            except OSError as exc:  # a full disk: the replay's error says what is safe
                logger.warning("the stopped run in %s is not summarized (%s)", config.output.result_dir, exc.strerror or exc)
            except Exception:  # the replay's own error is the one to report
                logger.exception("summarizing the stopped run in %s failed", config.output.result_dir)
        raise
    return score_and_summarize(config)


def trace_of_run(config: dict[str, Any], trace_path: Path | None = None) -> tuple[Trace, TraceTokenizer]:
    """The trace a run replayed: `trace_path`, else the file its config names, else the trace
    regenerated from the generator settings in its header (gen-trace is deterministic)."""
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer
    from kvbench.tracegen.trace_files import read_trace, trajectory_digest

    recorded = Path(config["trace_path"]) if config.get("trace_path") else None
    # A recorded path may be relative to where the run was made, or the file gone: regenerate then.
    path = trace_path or (recorded if recorded is not None and recorded.is_file() else None)
    if path is not None:
        trace = read_trace(path)
        return trace, load_tokenizer(trace.header.tokenizer)
    header = config["trace_header"]
    tokenizer = load_tokenizer(header["tokenizer"])
    generator = dict(header.get("generator") or {})
    if generator.pop("name", None) != "kvbench gen-trace":
        raise ValueError("the run's trace was not made by kvbench gen-trace and no trace file is recorded: pass --trace")
    generator.pop("kvbench_version", None)
    fields = set(TraceSpec.__dataclass_fields__)
    spec = TraceSpec(**{k: v for k, v in generator.items() if k in fields})
    trace = Trace(header=TraceHeader(**header), trajectories=generate_trace(spec, tokenizer)[1])
    digests = config.get("trajectory_digests") or {}
    regenerated = {t.trajectory_id: trajectory_digest(t) for t in trace.trajectories}
    if any(regenerated.get(t) != d for t, d in digests.items()):
        raise ValueError(f"the run's trace file {recorded} is gone and regenerating it from its gen-trace settings "
                         "gave other trajectories (another kvbench version or tokenizer?): pass --trace")
    return trace, tokenizer


def rescore(result_dir: Path, trace_path: Path | None = None) -> dict[str, Any]:
    """Score a recorded run of a task trace again and rewrite its summary; returns the summary."""
    config = json.loads((result_dir / run_files.CONFIG).read_text())
    trace, tokenizer = trace_of_run(config, trace_path)
    if not any(t.task is not None for t in trace.trajectories):
        raise ValueError(f"{result_dir}: its trace has no task to score "
                         "(make one with gen-trace --task recall, mmlu, gsm8k or humaneval)")
    require_consent_for(trace.trajectories)
    write_scores(result_dir, trace.trajectories, tokenizer)
    return write_summary(result_dir)
