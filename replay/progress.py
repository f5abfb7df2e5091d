"""The live progress line of a replay (rich): requests done of all, ok / failed, running p50 TTFT,
vLLM's prefix-cache hit share and the method's reuse share so far."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


class ReplayProgress:
    """`prefix_hit_share`: vLLM's prefix-cache hits over queries so far (its /metrics);
    `reused_tokens`: rows the connector served from reuse so far (its polled stats; None for
    plain vLLM). The reuse share is over the shared tokens of the requests finished."""

    def __init__(self, method: str, total: int, enabled: bool = True,
                 prefix_hit_share: Callable[[], float | None] = lambda: None,
                 reused_tokens: Callable[[], int | None] = lambda: None) -> None:
        self.method, self.total, self.enabled = method, total, enabled
        self.prefix_hit_share, self.reused_tokens = prefix_hit_share, reused_tokens
        self.completed = self.failed = 0
        self.shared_tokens = 0
        self._ttfts: list[float] = []
        self._bar: Any = None
        self._task: Any = None

    def start(self) -> None:
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn(f"replay {self.method}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("ok {task.fields[completed_n]}  failed {task.fields[failed_n]}  p50 TTFT {task.fields[p50]:.0f} ms"
                       "  prefix-cache hits {task.fields[hits]}  reuse {task.fields[reuse]}"),
            TimeElapsedColumn(), console=Console(stderr=True), transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task("replay", total=self.total, completed_n=0, failed_n=0, p50=float("nan"),
                                        hits="-", reuse="-")

    def reuse_share(self) -> float | None:
        """Reused rows over the shared tokens of the requests finished (None: no method stats yet)."""
        reused = self.reused_tokens()
        return None if reused is None or not self.shared_tokens else min(1.0, reused / self.shared_tokens)

    def add(self, success: bool, ttft_ms: float | None, shared_tokens: int = 0) -> None:
        if success:
            self.completed += 1
            self._ttfts.append(ttft_ms or 0.0)
            self.shared_tokens += shared_tokens
        else:
            self.failed += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, completed_n=self.completed, failed_n=self.failed,
                             p50=float(np.median(self._ttfts)) if self._ttfts else float("nan"),
                             hits=_share(self.prefix_hit_share()), reuse=_share(self.reuse_share()))

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
