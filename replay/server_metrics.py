"""Sample each server's Prometheus `/metrics` (before, ~3 Hz during, after) and its memory."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

from kvbench.replay.machine_load import MachineLoadSampler

logger = logging.getLogger(__name__)

# The vLLM series kvbench keeps (samples are named with their _total suffix for counters).
KEPT_SAMPLES = (
    "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "master_allocated_bytes", "master_key_count",  # a shared tier's Mooncake master (its own page)
)


def parse_metrics(text: str) -> dict[str, float]:
    """Kept vLLM samples, summed over label sets (one engine per server here). An answer that is
    not Prometheus text (a proxy's error page, say) gives nothing rather than ending the run."""
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in KEPT_SAMPLES:
                    values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        _warn_once("ignoring /metrics answers that are not Prometheus text (the first: %s)", str(exc)[:200])
        return {}
    return values


_warned: set[str] = set()


def _warn_once(message: str, detail: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message, detail)


def process_tree_rss(pid: int) -> int:
    """Resident memory of a process and all its descendants (API server, engine core, workers)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


@dataclass
class MetricsSampler:
    servers: list[str]
    pids: dict[str, int]  # server URL -> process id, for servers kvbench started
    # local servers it did not start, found by their port (replay/local_servers.py): their CPU is
    # the run's own; their memory is not sampled (a port-forward's listener is no server)
    found_pids: dict[str, int] = field(default_factory=dict)
    interval_s: float = 1 / 3
    samples: list[dict[str, Any]] = field(default_factory=list)
    # What else the machine did meanwhile (replay/machine_load.py), sampled from start to stop too.
    machine: MachineLoadSampler = field(init=False)
    # While it returns True the servers are not polled (an interleaved arm whose turn it is not).
    paused: Callable[[], bool] = lambda: False
    _task: asyncio.Task | None = None
    _started: float = 0.0

    def __post_init__(self) -> None:
        self.machine = MachineLoadSampler([*self.pids.values(), *self.found_pids.values()])

    async def sample(self, session: aiohttp.ClientSession, phase: str) -> None:
        now = time.monotonic() - self._started
        for url in self.servers:
            try:
                async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as response:
                    values = parse_metrics(await response.text()) if response.status == 200 else {}
            except (TimeoutError, aiohttp.ClientError, ConnectionError, UnicodeDecodeError):
                values = {}
            if url in self.pids:
                rss = process_tree_rss(self.pids[url])
                values["process_tree_rss_bytes"] = rss
            if values:
                self.samples.append({"server_url": url, "phase": phase, "t_s": round(now, 3), **values})

    async def device_memory(self, reset: bool) -> None:
        """Each server's workers' memory (WorkerRpc.MEMORY), recorded as a sample; `reset` starts
        a new peak. Servers without kvbench's worker extension are left out (no figure)."""
        from kvbench.server.errors import ServerError
        from kvbench.server.worker_rpc import WorkerClient

        for url in self.servers:
            try:
                ranks = await asyncio.to_thread(WorkerClient(url, timeout_s=30).memory, reset)
            except ServerError:
                continue
            self.samples.append({"server_url": url, "phase": "reset" if reset else "after",
                                 "t_s": round(time.monotonic() - self._started, 3),
                                 "device_memory": [rank.to_dict() for rank in ranks]})

    async def start(self, session: aiohttp.ClientSession) -> None:
        self._started = time.monotonic()
        await self.device_memory(reset=True)
        await self.sample(session, "before")

        async def loop() -> None:
            while True:
                await asyncio.sleep(self.interval_s)
                if not self.paused():
                    await self.sample(session, "during")

        self._task = asyncio.create_task(loop())
        self.machine.start()

    async def stop(self, session: aiohttp.ClientSession) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.machine.stop()
        await self.sample(session, "after")
        await self.device_memory(reset=False)

    def prefix_cache_hit_share(self) -> float | None:
        """vLLM's prefix-cache hits over its queries (tokens) since the run started, over every
        server (None before a server answered twice)."""
        hits = queries = 0.0
        for url in self.servers:
            series = [s for s in self.samples if s["server_url"] == url and "vllm:prefix_cache_queries_total" in s]
            if len(series) >= 2:
                hits += series[-1].get("vllm:prefix_cache_hits_total", 0.0) - series[0].get("vllm:prefix_cache_hits_total", 0.0)
                queries += series[-1]["vllm:prefix_cache_queries_total"] - series[0]["vllm:prefix_cache_queries_total"]
        return hits / queries if queries > 0 else None

    def write(self, path: Path) -> None:
        path.write_text("".join(json.dumps(s) + "\n" for s in self.samples))
