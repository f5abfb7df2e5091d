"""The segment store's per-run figures, reuse lost to its cap, and the options that set the cap
and inject faults."""

from __future__ import annotations

import json

import click
import pandas as pd
import pytest
import torch
from click.testing import CliRunner, Result

from kvbench.analysis.metrics import realized_rho, recompute_share, reuse_figures
from kvbench.cli.server_options import ServerOptions, server_options
from kvbench.methods.core.store import SavedKV, SegmentStore
from kvbench.methods.registry import resolve_method


def _entry(tokens: int) -> SavedKV:
    return SavedKV(torch.zeros(tokens, dtype=torch.long), torch.zeros(2, tokens, 1, 4), torch.zeros(2, tokens, 1, 4))


def _bytes_by_hand(tokens: int) -> int:
    """What _entry(tokens) holds, counted here: int64 token ids, and K and V of 2 layers x 1 head x
    4 dims in fp32 per token."""
    return tokens * 8 + 2 * (2 * tokens * 1 * 4 * 4)


def test_store_evicts_least_recently_used_and_counts_per_run() -> None:
    size = _bytes_by_hand(10)
    assert _entry(10).nbytes == size
    store = SegmentStore(max_bytes=2 * size)
    store.put("a", _entry(10))
    store.put("b", _entry(10))
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put("c", _entry(10))
    assert list(store.entries) == ["a", "c"] and store.evictions == 1
    store.put("huge", _entry(100))  # larger than the whole cap: refused, nothing evicted for it
    assert store.refused == 1 and "huge" not in store.entries and store.evictions == 1
    assert store.peak_bytes == 2 * size
    store.clear()  # a new run: its figures are its own, not the server's lifetime
    assert (store.bytes, store.peak_bytes, store.evictions, store.refused) == (0, 0, 0, 0)
    store.put("d", _entry(5))
    assert store.peak_bytes == store.bytes == _bytes_by_hand(5)


def test_reuse_lost_to_eviction_is_counted_beside_realized_rho() -> None:
    requests = pd.DataFrame({
        "reusable_tokens": [0, 100, 100], "reused_tokens": [0, 17, 0], "eligible_tokens": [0, 20, 0],
        "source_missing_tokens": [0, 0, 80], "success": [True, True, True]})
    figures = reuse_figures(requests)
    # 100 tokens could have been reused with an unbounded store: 17 were, 80 had been evicted
    assert figures["realized_rho"] == pytest.approx(17 / 100)
    assert figures["eligible_rho"] == pytest.approx(17 / 20)
    assert figures["reuse_lost_to_eviction_tokens"] == 80
    assert figures["reuse_lost_to_eviction_share"] == pytest.approx(0.8)
    assert realized_rho(requests) == figures["realized_rho"]
    # runs recorded before the column existed: nothing was counted as lost
    old = requests.drop(columns=["source_missing_tokens"])
    assert reuse_figures(old)["realized_rho"] == pytest.approx(17 / 20)
    assert reuse_figures(requests.assign(reused_tokens=None))["realized_rho"] is None



def test_recompute_share_counts_layers_the_reused_rows_computed() -> None:
    stats = [{"served_entries": 0, "layers": 4}, {"served_entries": 17 * 4, "layers": 4},  # every layer
             {"served_entries": 40 * 3, "layers": 4}]  # 40 rows served in 3 of 4 layers
    requests = pd.DataFrame({
        "reusable_tokens": [0, 100, 100], "reused_tokens": [0, 17, 40], "eligible_tokens": [0, 20, 100],
        "source_missing_tokens": [0, 80, 0], "method_stats": [json.dumps(s) for s in stats]})
    assert recompute_share(requests) == pytest.approx(1 - (17 + 30) / 200)
    assert realized_rho(requests) == pytest.approx((17 + 40) / 200)  # rho counts rows, not entries
    # a connector that reused rows without counting entries (an older run): no figure, not a guess
    older = requests.assign(method_stats=[json.dumps({"layers": 4})] * 3)
    assert recompute_share(older) is None
    assert recompute_share(requests.assign(reused_tokens=None)) is None

def _server_options(*args: str) -> tuple[Result, ServerOptions | None]:
    """The server options a command gets from these arguments (None when click refused them)."""
    seen: dict[str, ServerOptions] = {}

    @click.command()
    @server_options
    def command(server: ServerOptions) -> None:
        seen["options"] = server

    result = CliRunner().invoke(command, list(args))
    return result, seen.get("options")


def test_store_cap_and_fault_injection_are_kvbench_options() -> None:
    from kvbench.methods.connector.settings import ConnectorSettings

    result, options = _server_options("--max-store-bytes", "32MiB", "--fault-injection", "0.25")
    assert result.exit_code == 0 and options is not None, result.output
    extra = options.server_config(resolve_method("kvcmas"), "model").kv_transfer_config["kv_connector_extra_config"]
    settings = ConnectorSettings.from_extra_config(extra)
    assert settings.max_store_bytes == 32 * 2**20 and settings.fault_injection == "0.25"
    assert options.server_config(resolve_method("nonshared"), "model").kv_transfer_config is None  # plain vLLM: no store
    for bad in (("--max-store-bytes", "lots"), ("--max-store-bytes", "0"), ("--fault-injection", "1.5"),
                ("--fault-injection", "sometimes")):
        result, _ = _server_options(*bad)
        assert result.exit_code == 2 and "Invalid value" in result.output, bad


def test_a_fault_fraction_fails_that_share_of_loads_alike_everywhere() -> None:
    from kvbench.methods.connector.settings import fault_fraction, fault_hash

    keys = [f"run/s0/t{i:06d}/A1.r0" for i in range(4000)]
    share = sum(fault_hash(k) < 0.25 for k in keys) / len(keys)
    assert share == pytest.approx(0.25, abs=0.03)
    assert [fault_hash(k) for k in keys[:5]] == [fault_hash(k) for k in keys[:5]]  # deterministic
    assert fault_fraction("0.25") == 0.25 and fault_fraction("all") is None and fault_fraction("0") is None


def test_a_fractional_cpu_kv_cache_reaches_vllm_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM CPU's VLLM_CPU_KVCACHE_SPACE takes whole GiB only (0.5 stopped vLLM at start-up)."""
    from kvbench.server import lifecycle as server

    monkeypatch.setattr(server, "_has_cuda", lambda: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    result, options = _server_options("--cpu-kv-cache-gib", "0.5")
    assert result.exit_code == 0 and options is not None, result.output
    command = server.VLLMServer(options.server_config(resolve_method("nonshared"), "model", port=1)).command()
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(2**29)
    plain = server.VLLMServer(options.server_config(resolve_method("nonshared"), "m"))
    assert "VLLM_CPU_KVCACHE_SPACE" not in plain.environment()
    assert _server_options("--cpu-kv-cache-gib", "0")[0].exit_code == 2


def test_eager_servers_are_asked_for_by_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVBENCH_ENFORCE_EAGER=1 (the engine test tier's) makes every server kvbench starts eager;
    an explicit --vllm-arg=--enforce-eager is not passed twice."""
    from kvbench.server.config import ENFORCE_EAGER_ENV, ServerConfig
    from kvbench.server.lifecycle import VLLMServer

    monkeypatch.delenv(ENFORCE_EAGER_ENV, raising=False)
    assert "--enforce-eager" not in VLLMServer(ServerConfig("m", port=1)).command()
    monkeypatch.setenv(ENFORCE_EAGER_ENV, "1")
    assert VLLMServer(ServerConfig("m", port=1)).command().count("--enforce-eager") == 1
    explicit = ServerConfig("m", port=1, extra_args=["--enforce-eager"])
    assert VLLMServer(explicit).command().count("--enforce-eager") == 1
    assert "--enforce-eager" not in VLLMServer(ServerConfig("m", port=1, enforce_eager=False)).command()


def test_a_source_larger_than_the_cap_is_a_refusal_not_an_eviction() -> None:
    from kvbench.contracts import Plan, PlanSegment
    from kvbench.methods.connector.materialize import find_candidates
    from kvbench.methods.connector.specs import LoadSpec

    store = SegmentStore(max_bytes=_bytes_by_hand(10))
    store.put("huge", _entry(40))  # never stored
    store.put("small", _entry(5))
    store.put("gone", _entry(8))  # evicts "small"
    assert store.was_refused("huge") and not store.was_refused("small") and store.evictions == 1
    segments = (PlanSegment("ph", "q", 0, 4, source="huge", source_start=0),
                PlanSegment("ph", "r", 4, 3, source="small", source_start=0))
    spec = LoadSpec("r", list(range(8)), [0], 0, 7, Plan("t", "A1.r0", "A1", "k", segments=segments))
    found = find_candidates(store, spec, torch.arange(8))
    assert (found.evicted, found.refused) == (7, 4)  # 4 rows refused, 3 evicted: both missing sources
    store.put("huge", _entry(3))  # stored after all: no longer a refusal
    assert not store.was_refused("huge")
    store.put("huge2", _entry(40))
    store.clear()
    assert not store.was_refused("huge2")
    # The summary splits the lost rows by the stats' refused count.
    requests = pd.DataFrame({
        "reusable_tokens": [100], "reused_tokens": [20], "eligible_tokens": [20], "source_missing_tokens": [80],
        "method_stats": [json.dumps({"source_refused_tokens": 30})], "success": [True]})
    figures = reuse_figures(requests)
    assert figures["reuse_lost_to_eviction_tokens"] == 50 and figures["reuse_lost_to_refusal_tokens"] == 30
    assert figures["reuse_lost_to_refusal_share"] == pytest.approx(0.3) and figures["realized_rho"] == pytest.approx(0.2)
