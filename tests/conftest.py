"""Shared fixtures. Engine starts are expensive (~35 s), so servers are session-scoped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_helpers import serving

from kvbench.contracts import WorkerRpc
from kvbench.methods.registry import WORKER_EXTENSION, kv_transfer_config, resolve_method
from kvbench.model.resolve import resolve_model
from kvbench.server.config import ServerConfig
from kvbench.server.lifecycle import VLLMServer, wait_for_stopped_servers

# KV slots of the connector server: small enough that concurrent long requests get preempted.
FULLSHARED_BLOCKS = 56


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that runs the embedded model through the `default_model` fixture belongs to the engine
    tier, like the tests that start vLLM: `pytest -m "not engine"` is the unit tier."""
    for item in items:
        if "default_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session", autouse=True)
def _servers_stopped_at_the_end() -> Iterator[None]:
    """Servers stop in the background (vllm_helpers.serving): none outlives the session."""
    yield
    wait_for_stopped_servers()


@pytest.fixture(scope="session")
def default_model() -> str:
    """The embedded default model (shipped with the package: nothing to build)."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def vllm_server(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One plain vLLM server (no connector; kvbench's worker extension, as NonShared's servers have
    it, for its memory RPC) on the embedded model, shared by the whole session (with a plain chat
    template, for clients that send chat requests)."""
    log = Path(tmp_path_factory.mktemp("vllm")) / "server.log"
    template = Path(__file__).parent / "data" / "plain-chat-template.jinja"
    with serving(ServerConfig(model=default_model, log_path=log, max_model_len=8192, worker_extension_cls=WORKER_EXTENSION,
                              extra_args=["--chat-template", str(template)])) as server:
        yield server


@pytest.fixture(scope="session")
def fullshared_server(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A server running the kvbench connector with FullShared (faults injectable per request)."""
    config = ServerConfig(
        model=default_model, log_path=Path(tmp_path_factory.mktemp("fullshared")) / "server.log",
        max_model_len=4096, kv_transfer_config=kv_transfer_config(resolve_method("fullshared"), fault_injection="flagged"),
        worker_extension_cls=WORKER_EXTENSION, post_start_rpcs=[WorkerRpc.ATTACH_MODEL],
        extra_args=["--num-gpu-blocks-override", str(FULLSHARED_BLOCKS)])
    with serving(config) as server:
        yield server


@pytest.fixture(scope="session")
def small_trace(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Makes a small four-agent trace with `kvbench gen-trace` on the tiny tokenizer (for replays
    against a stub): small_trace(trajectories, shared_tokens, output_len) -> its path."""
    from click.testing import CliRunner

    from kvbench.cli import main

    def make(trajectories: int, shared_tokens: int, output_len: int) -> Path:
        path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
        result = CliRunner().invoke(main, ["gen-trace", "-o", str(path), "--model", str(tiny_tokenizer_dir),
                                           "--num-trajectories", str(trajectories), "--shared-tokens",
                                           str(shared_tokens), "--output-len", str(output_len)])
        assert result.exit_code == 0, result.output
        return path

    return make


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


@pytest.fixture(scope="session")
def prompts(default_model: str) -> dict[str, list[int]]:
    """A0's prompt (system + q), and A1's prompt (another system prompt, q at other positions)."""
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    _, (trajectory,) = generate_trace(TraceSpec(shared_tokens=1500, num_trajectories=1, seed=42), tokenizer)
    q = tokenizer.encode(trajectory.shared["q"].text)
    sys0 = tokenizer.encode(trajectory.agents["A0"].system)
    sys1 = tokenizer.encode(trajectory.agents["A1"].system)
    tail = tokenizer.encode("\n\nA: ")
    return {"sys0": sys0, "sys1": sys1, "q": q, "tail": tail, "p0": sys0 + q + tail, "p1": sys1 + q + tail}
