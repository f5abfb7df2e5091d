"""The servers a run replays against: checked once before anything is sent (reachable, serving a
model, running the run's method, long enough for the trace), and reset to cold caches."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvbench.contracts import WorkerStats
from kvbench.replay.run_config import ReplayError
from kvbench.server.errors import ServerError
from kvbench.server.worker_rpc import WorkerClient
from kvbench.tracegen.schema import Trace


@dataclass
class ReplayServers:
    base_urls: list[str]
    method: str
    uses_connector: bool
    served_models: dict[str, str] = field(default_factory=dict)
    # every model id each server lists: its base model, then the LoRA adapters it serves
    served_ids: dict[str, set[str]] = field(default_factory=dict)
    max_model_lens: dict[str, int | None] = field(default_factory=dict)
    # Whether every server reads the others' caches: their connectors share one Mooncake master.
    shared_tier: bool = False

    async def check(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """Ask every server what it serves; raises ServerError naming one that does not answer,
        ContractError for one running another method. Returns the entries for config.json."""
        versions: dict[str, str | None] = {}
        for url in self.base_urls:
            try:
                async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as response:
                    response.raise_for_status()
                    listed = (await response.json())["data"]
                    served = listed[0]
                    self.served_models[url] = served["id"]
                    self.served_ids[url] = {str(entry["id"]) for entry in listed}
                    limit = served.get("max_model_len")
                    self.max_model_lens[url] = limit if isinstance(limit, int) and limit > 0 else None
                async with session.get(f"{url}/version", timeout=aiohttp.ClientTimeout(total=10)) as response:
                    versions[url] = (await response.json()).get("version") if response.status == 200 else None
            except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError) as exc:
                raise ServerError(f"cannot reach a vLLM server at {url}: {type(exc).__name__}: {exc}") from None
        entries: dict[str, Any] = {}
        if self.uses_connector:  # a server of another method would answer other stats
            infos = {url: await asyncio.to_thread(WorkerClient(url).check_method, self.method) for url in self.base_urls}
            entries["server_info"] = {url: info.to_dict() for url, info in infos.items()}
            masters = {(info.shared_tier or {}).get("master") for info in infos.values()}
            self.shared_tier = len(self.base_urls) > 1 and None not in masters and len(masters) == 1
            entries["shared_tier_readable"] = self.shared_tier
        return {**entries, "served_models": dict(self.served_models),
                "served_max_model_len": dict(self.max_model_lens),
                "vllm_version": next(iter(versions.values()), None)}

    def refuse_unservable(self, trace: Trace) -> None:
        """Raise ReplayError, before anything is sent, for a trace the servers cannot serve: LoRA
        adapters its agents use that a server does not serve, or turns longer than its context."""
        from kvbench.tracegen.validate import length_problems

        wanted = sorted({agent.adapter for t in trace.trajectories for agent in t.agents.values() if agent.adapter})
        paths = trace.header.adapters or {}
        missing = [f"{url} does not serve adapter {name!r} (start it with --enable-lora --lora-modules "
                   f"{name}={paths.get(name, 'PATH')})"
                   for url in self.base_urls for name in wanted if name not in self.served_ids.get(url, set())]
        if missing:
            raise ReplayError("the trace's agents use LoRA adapters the server does not serve:\n  " + "\n  ".join(missing))
        limits = [n for n in self.max_model_lens.values() if n]
        problems = length_problems(trace, min(limits)) if limits else []
        if problems:
            shown = "\n  ".join(problems[:5]) + (f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise ReplayError(f"{len(problems)} turns need more tokens than the server's max_model_len {min(limits)}; "
                              f"serve a longer context (--max-model-len) or use a shorter trace:\n  {shown}")

    async def reset(self, session: aiohttp.ClientSession, keep_method_state: bool = False) -> None:
        """Cold caches (vLLM's prefix cache needs VLLM_SERVER_DEV_MODE=1 on the server)."""
        for url in self.base_urls:
            if self.uses_connector:
                client = WorkerClient(url)
                await asyncio.to_thread(client.attach_model)  # idempotent; servers not started by kvbench
                await asyncio.to_thread(client.reset, keep_method_state)
            try:
                async with session.post(f"{url}/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=30)):
                    pass
            except (TimeoutError, aiohttp.ClientError):
                pass  # servers without dev mode keep their cache; recorded cached_tokens show it

    @staticmethod
    async def fetch_stats(url: str) -> list[WorkerStats]:
        """The connector's stats since the last poll, cleared (one answer per worker)."""
        return await asyncio.to_thread(WorkerClient(url).stats, True)


UNREACHABLE_GRACE_S = 2.0  # for a managed server's process to be gone once it refuses connections


async def unreachable_reason(failure: Callable[[], str | None], url: str, message: str | None) -> str:
    """Why a run stops on a server that refuses connections. A server kvbench started that was
    killed refuses them before its process is gone: wait a moment for it (`failure()` says why it
    ended), so the reason says what happened to it (killed by a signal, out of memory) rather than
    only that it is unreachable."""
    deadline = time.monotonic() + UNREACHABLE_GRACE_S
    while time.monotonic() < deadline:
        if (reason := failure()) is not None:
            return reason
        await asyncio.sleep(0.05)
    return f"server {url} is unreachable ({message})"
