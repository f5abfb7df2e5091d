"""What else the machine did while a run ran: CPU time of processes outside kvbench and its
servers, CPU time stolen by the hypervisor, memory available and memory pressure. A timing taken
while a neighbour used the cores is no measurement of the method; recorded with the run (its
`machine_load.jsonl`, summarized in summary.json), the console, the report and `kvbench compare`
can say so. As pyperf records system state beside its timings.

"Ours" is this process and its descendants (the servers kvbench started are its children) plus
the pids a run names (servers it was pointed at, where their pid is known); everything else on
the machine is "others"."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

SAMPLE_INTERVAL_S = 1.0
# A run whose other processes used more than this share of the machine's cores is flagged: its
# timings measured the neighbours too (0.1 of 2 cores: a fifth of one core, on average).
LOADED_SHARE = 0.10


def _busy_s(times: Any) -> float:
    """CPU seconds spent working (steal left out: the hypervisor's, not this machine's)."""
    idle = getattr(times, "idle", 0.0) + getattr(times, "iowait", 0.0) + getattr(times, "steal", 0.0)
    return sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


def _memory_pressure() -> float | None:
    """The share of the last 10 s some task stalled on memory (Linux PSI), if the kernel says."""
    try:
        first = Path("/proc/pressure/memory").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(part.split("=", 1) for part in first.split()[1:] if "=" in part)
    try:
        return float(fields["avg10"]) / 100
    except (KeyError, ValueError):
        return None


@dataclass
class MachineLoadSampler:
    """Samples the machine every `interval_s` while started; `samples` one dict per interval."""

    pids: list[int] = field(default_factory=list)  # roots of other processes that count as ours
    interval_s: float = SAMPLE_INTERVAL_S
    samples: list[dict[str, Any]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _ours: dict[int, float] = field(default_factory=dict)  # pid -> CPU seconds at the last sample
    _last: tuple[float, float, float] | None = None  # (monotonic, busy, steal) at the last sample

    def _our_processes(self) -> list[psutil.Process]:
        roots = [os.getpid(), *self.pids]
        found: dict[int, psutil.Process] = {}
        for pid in roots:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                for process in (root, *root.children(recursive=True)):
                    found[process.pid] = process
        return list(found.values())

    def _our_delta_s(self) -> float:
        """CPU seconds our processes used since the last sample (a new one: all of its own)."""
        now: dict[int, float] = {}
        for process in self._our_processes():
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                now[process.pid] = times.user + times.system
        delta = sum(seconds - self._ours.get(pid, 0.0) for pid, seconds in now.items())
        self._ours = now
        return max(delta, 0.0)

    def sample(self) -> dict[str, Any] | None:
        """One interval's figures (None for the first call, which only sets the baseline)."""
        times = psutil.cpu_times()
        moment = (time.monotonic(), _busy_s(times), getattr(times, "steal", 0.0))
        ours = self._our_delta_s()
        last, self._last = self._last, moment
        if last is None:
            return None
        wall = moment[0] - last[0]
        if wall <= 0:
            return None
        cores = psutil.cpu_count() or 1
        busy, steal = moment[1] - last[1], moment[2] - last[2]
        memory = psutil.virtual_memory()
        record = {"t": round(time.time(), 3), "wall_s": round(wall, 3), "cores": cores,
                  "busy_share": round(busy / (wall * cores), 4),
                  "ours_share": round(min(ours, busy) / (wall * cores), 4),
                  "others_share": round(max(busy - ours, 0.0) / (wall * cores), 4),
                  "steal_share": round(steal / (wall * cores), 4),
                  "available_bytes": memory.available, "memory_pressure": _memory_pressure()}
        self.samples.append(record)
        return record

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.to_thread(self.sample)

    def start(self) -> None:
        self.sample()  # the baseline
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.sample()  # the last stretch


def describe_machine() -> dict[str, Any]:
    """The client machine in a few words (config.json's `machine`; its servers run on it unless
    the run was pointed at others)."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model or None, "cores": psutil.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)}


def load_figures(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's load figures from its samples (weighted by their wall time): the share of the
    machine's cores other processes used, and stolen, on average and at the worst 10% of the run;
    the least memory available; the highest memory pressure; `machine_loaded` when others used
    more than LOADED_SHARE of the cores."""
    timed = [s for s in samples if s.get("wall_s")]
    if not timed:
        return {}
    wall = sum(s["wall_s"] for s in timed)
    others = sum(s["others_share"] * s["wall_s"] for s in timed) / wall
    steal = sum(s["steal_share"] * s["wall_s"] for s in timed) / wall
    ordered = sorted(s["others_share"] for s in timed)
    pressures = [s["memory_pressure"] for s in timed if s.get("memory_pressure") is not None]
    return {"others_cpu_share": round(others, 4), "p90_others_cpu_share": ordered[int(0.9 * (len(ordered) - 1))],
            "steal_cpu_share": round(steal, 4),
            "min_available_memory_bytes": min(s["available_bytes"] for s in timed),
            "max_memory_pressure": max(pressures) if pressures else None,
            "machine_loaded": others > LOADED_SHARE, "machine_load_samples": len(timed)}
