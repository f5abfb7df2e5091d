"""One replay and its summary."""

from __future__ import annotations

import logging
from typing import Any

from kvbench import run_files
from kvbench.analysis.summary import write_summary
from kvbench.replay.runner import ReplayConfig, run_replay

logger = logging.getLogger(__name__)


def replay_and_summarize(config: ReplayConfig) -> dict[str, Any]:
    """Replay `config`, then write `summary.json` from what it recorded and return it. A run that
    was aborted or stopped by a signal is summarized too (the summary says which) before the
    error propagates; one that never reached its servers left nothing to summarize."""
    try:
        run_replay(config)
    except BaseException:
        if (config.result_dir / run_files.REQUESTS).exists():
            try:
                write_summary(config.result_dir)
            except Exception:  # the replay's own error is the one to report
                logger.exception("summarizing the stopped run in %s failed", config.result_dir)
        raise
    return write_summary(config.result_dir)
