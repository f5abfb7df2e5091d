"""The live progress line of a replay (rich): requests done of all, ok / failed, running p50 TTFT."""

from __future__ import annotations

from typing import Any

import numpy as np


class ReplayProgress:
    def __init__(self, method: str, total: int, enabled: bool = True) -> None:
        self.method, self.total, self.enabled = method, total, enabled
        self.completed = self.failed = 0
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
            TextColumn("ok {task.fields[completed_n]}  failed {task.fields[failed_n]}  p50 TTFT {task.fields[p50]:.0f} ms"),
            TimeElapsedColumn(), console=Console(stderr=True), transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task("replay", total=self.total, completed_n=0, failed_n=0, p50=float("nan"))

    def add(self, success: bool, ttft_ms: float | None) -> None:
        if success:
            self.completed += 1
            self._ttfts.append(ttft_ms or 0.0)
        else:
            self.failed += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, completed_n=self.completed, failed_n=self.failed,
                             p50=float(np.median(self._ttfts)) if self._ttfts else float("nan"))

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
