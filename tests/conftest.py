"""Shared fixtures. Engine starts are expensive (~35 s), so servers are session-scoped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbench.model.store import resolve_model
from kvbench.replay.server import ServerConfig, VLLMServer


@pytest.fixture(scope="session")
def default_model() -> str:
    """The embedded default model, built on first use and cached (about 3 minutes once)."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def vllm_server(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One plain vLLM server (no connector) on the embedded model, shared by the whole session."""
    log = Path(tmp_path_factory.mktemp("vllm")) / "server.log"
    with VLLMServer(ServerConfig(model=default_model, log_path=log, max_model_len=8192)) as server:
        yield server
