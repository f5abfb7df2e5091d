"""Shared fixtures. Engine starts are expensive (~35 s), so servers are session-scoped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbench.contracts import WorkerRpc
from kvbench.methods.registry import WORKER_EXTENSION, kv_transfer_config
from kvbench.model.store import resolve_model
from kvbench.replay.server import ServerConfig, VLLMServer, method_server_config

# KV slots of the connector server: small enough that concurrent long requests get preempted.
FULLSHARED_BLOCKS = 56


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that needs the embedded model (built on first use, ~3 minutes) belongs to the engine
    tier, like the tests that start vLLM: `pytest -m "not engine"` is the unit tier."""
    for item in items:
        if "default_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)


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


@pytest.fixture(scope="session")
def fullshared_server(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A server running the kvbench connector with FullShared (faults injectable per request)."""
    config = ServerConfig(
        model=default_model, log_path=Path(tmp_path_factory.mktemp("fullshared")) / "server.log",
        max_model_len=4096, kv_transfer_config=kv_transfer_config("fullshared", fault_injection="flagged"),
        worker_extension_cls=WORKER_EXTENSION, post_start_rpcs=[WorkerRpc.ATTACH_MODEL],
        extra_args=["--num-gpu-blocks-override", str(FULLSHARED_BLOCKS)])
    with VLLMServer(config) as server:
        yield server


def method_server(method: str, model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """Body of a module-scoped fixture: a connector server running `method` with its defaults."""
    config = method_server_config(method, model, max_model_len=4096,
                                  log_path=Path(tmp_path_factory.mktemp(method)) / "server.log")
    with VLLMServer(config) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE saved as a Hugging Face tokenizer directory (what `--model DIR`
    loads): traces made, validated and replayed against a stub with no model build."""
    from kvbench.model.tokenizer import save_hf_tokenizer, train_tokenizer
    from kvbench.tracegen.roles import ROLE_POOL

    documents = [role.system for role in ROLE_POOL.values()]
    documents += [f"The council reviewed report {i} near the harbor and approved budget {i * 7}." for i in range(200)]
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    save_hf_tokenizer(train_tokenizer(documents, vocab_size=400), out, model_max_length=1 << 20)
    return out
