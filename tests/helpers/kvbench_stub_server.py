"""`kvbench` whose started servers are kvbench's stub instead of vLLM: the command line's own
process handling (signals, the server's process group, exit codes) tested without an engine.

The stub starts a child that ignores SIGTERM, as vLLM starts engine processes, so only a kill of
the whole process group ends it. Each streamed token waits STUB_TOKEN_DELAY seconds.
"""

from __future__ import annotations

import os
import sys

from kvbench.server import lifecycle as server


def _stub_command(self: server.VLLMServer) -> list[str]:
    return [sys.executable, "-m", "kvbench.replay.stub", "--port", str(self.port), "--child", "--connector",
            "--token-delay", os.environ.get("STUB_TOKEN_DELAY", "0.02")]


server.VLLMServer.command = _stub_command  # type: ignore[method-assign]

if __name__ == "__main__":
    from kvbench.cli import main

    main(prog_name="kvbench")
