"""The vLLM server an experiment runs against: one the user runs (`--base-url`), or one started for
it and stopped however the experiment ends (kvbench.server.lifecycle.VLLMServer)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from kvbench.replay.run_config import ReplayConfig, ServerBinding
from kvbench.server import lifecycle as vllm_server  # (VLLMServer looked up at start: tests stand one in)
from kvbench.server.config import ServerConfig
from kvbench.server.instances import InstancePlan, ServerGroup


@contextlib.contextmanager
def server_url(base_url: str | None, make_config: Callable[[], ServerConfig]) -> Iterator[str]:
    """`base_url` as given, else the URL of a server started from `make_config()`."""
    if base_url is not None:
        yield base_url.rstrip("/")
        return
    with vllm_server.VLLMServer(make_config()) as server:
        yield server.base_url


@contextlib.contextmanager
def replay_server(config: ReplayConfig, server_config: ServerConfig | None,
                  announce: Callable[[ServerConfig], Any] = lambda _: None,
                  instances: InstancePlan | None = None) -> Iterator[ReplayConfig]:
    """`config` bound to a replay's server: one started from `server_config`, whose URL, pid, failure
    check and command the replay then records, or `instances` of it (and their shared tier); None:
    the running ones `config` names."""
    if server_config is None:
        yield config
        return
    announce(server_config)
    running: ServerGroup | vllm_server.VLLMServer
    if instances is not None and instances.grouped:
        running = ServerGroup(server_config, instances, config.output.result_dir)
    else:
        running = vllm_server.VLLMServer(server_config)
    with running as server:
        yield config.with_servers(ServerBinding(server.base_urls, server.pids, server.failure, server.tier_url),
                                  server_command=server.command(), **server.describe())
