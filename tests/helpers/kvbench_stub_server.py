"""`kvbench` whose started servers are kvbench's stub instead of vLLM: the command line's own
process handling (signals, the server's process group, exit codes) tested without an engine.

The stub starts a child that ignores SIGTERM, as vLLM starts engine processes, so only a kill of
the whole process group ends it. Each streamed token waits STUB_TOKEN_DELAY seconds; with
STUB_FAIL_START set, every server exits during its start.
"""

from __future__ import annotations

import os
import sys

import psutil

from kvbench.experiment import interleaved
from kvbench.server import lifecycle as server


def _stub_command(self: server.VLLMServer) -> list[str]:
    if os.environ.get("STUB_FAIL_START"):  # a server that exits during its start, as a misconfigured vLLM does
        return [sys.executable, "-c", "import sys; print('stub: refusing to start'); sys.exit(3)"]
    transfer = self.config.kv_transfer_config or {}
    method = (transfer.get("kv_connector_extra_config") or {}).get("method", "fullshared")
    return [sys.executable, "-m", "kvbench.replay.stub", "--port", str(self.port), "--child", "--connector",
            "--connector-method", method, "--token-delay", os.environ.get("STUB_TOKEN_DELAY", "0.02")]


STUB_SERVER_BYTES = 200 << 20  # what a stub server holds at most: a Python process, no KV pool, no weights


def _stub_shortfall(servers: int, cpu_kv_cache_gib: float, weights_bytes: int, available_bytes: int | None = None):
    """The side-by-side memory check for stubs: what they need, not what vLLM servers would (a
    loaded test machine must not refuse an interleaved sweep of stubs)."""
    available = available_bytes if available_bytes is not None else psutil.virtual_memory().available
    return None if servers * STUB_SERVER_BYTES <= 0.9 * available else f"{servers} stub servers do not fit"


def use_stub_servers() -> None:
    """Also what each Ray worker runs first (KVBENCH_RAY_WORKER_SETUP=kvbench_stub_server.use_stub_servers)."""
    server.VLLMServer.command = _stub_command  # type: ignore[method-assign]
    interleaved.side_by_side_shortfall = _stub_shortfall


use_stub_servers()

if __name__ == "__main__":
    from kvbench.cli import main

    main(prog_name="kvbench")
