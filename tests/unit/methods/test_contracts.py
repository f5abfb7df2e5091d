"""The replay <-> connector contracts: plans, worker RPCs and stats, and what a mismatch says."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.contracts import CONTRACT_VERSION, ContractError, Plan, PlanSegment, ServerInfo, WorkerRpc, WorkerStats
from kvbench.methods import registry
from kvbench.methods.api.base import load_implementation
from kvbench.methods.api.spec import MethodSpec
from kvbench.methods.core.errors import MethodConfigError
from kvbench.replay.stub import StubServer
from kvbench.server.errors import ServerError
from kvbench.server.worker_rpc import WorkerClient


def test_a_plan_survives_the_trip_through_kv_transfer_params() -> None:
    plan = Plan("t", "A1.r0", "A1", "run/t/A1.r0", (
        PlanSegment("pf", "system", 0, 10),
        PlanSegment("ph", "q", 10, 64, source="run/t/A0.r0", source_start=7, source_turn="A0.r0", source_agent="A0",
                    source_adapter="writer-lora")), adapter="reader-lora")
    params = plan.to_params()
    assert params["kvbench"]["version"] == CONTRACT_VERSION
    assert Plan.from_params(params) == plan
    assert Plan.from_params({}) is None and Plan.from_params(None) is None
    assert plan.sources == {"run/t/A0.r0"}


@pytest.mark.parametrize("raw, message", [
    ({"version": CONTRACT_VERSION + 1, "segments": []},
     f"plan version {CONTRACT_VERSION + 1}, this kvbench reads version {CONTRACT_VERSION}"),
    ({"version": CONTRACT_VERSION, "claim": True, "segments": []}, "claim must be one of method, all, none"),
    ({"segments": []}, "plan version None"),
    ({"version": CONTRACT_VERSION, "segments": [{"kind": "xx", "id": "q", "start": 0, "length": 1}]},
     "kind must be 'pf' or 'ph'"),
    ({"version": CONTRACT_VERSION, "segments": [{"kind": "ph", "id": "q", "start": 0}]}, "bad plan segment"),
    ({"version": CONTRACT_VERSION, "segments": "q"}, "segments must be a list"),
])
def test_an_unreadable_plan_is_a_contract_error(raw: dict, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        Plan.from_params({"kvbench": raw})


def test_stats_of_another_contract_version_or_missing_keys_are_refused() -> None:
    stats = WorkerStats("kvcmas", {}, {}, 1, 2, 3, 4, 5, {"anchor_pool": 6}, True)
    assert WorkerStats.from_dict(stats.to_dict()) == stats
    with pytest.raises(ContractError, match="speaks kvbench contract version 0"):
        WorkerStats.from_dict({**stats.to_dict(), "contract_version": 0})
    raw = stats.to_dict()
    del raw["store_peak_bytes"]
    with pytest.raises(ContractError, match="lacks store_peak_bytes"):
        WorkerStats.from_dict(raw)
    with pytest.raises(ContractError, match="expected an object"):
        ServerInfo.from_dict(["kvcmas"])


def test_every_worker_rpc_is_a_method_of_the_worker_extension() -> None:
    from kvbench.methods.connector.worker_ext import KVBenchWorkerExtension

    assert all(callable(getattr(KVBenchWorkerExtension, rpc.value, None)) for rpc in WorkerRpc)


def test_the_client_asks_which_method_a_server_runs() -> None:
    with StubServer(connector=True, connector_method="kvcmas") as stub:
        client = WorkerClient(stub.base_url)
        assert client.check_method("kvcmas").method == "kvcmas"
        with pytest.raises(ServerError, match="runs method 'kvcmas', not 'fullshared': replay with --method kvcmas"):
            client.check_method("fullshared")
    with StubServer() as plain, pytest.raises(ServerError, match="does not answer kvbench's worker RPCs"):
        WorkerClient(plain.base_url).info()


def test_replaying_against_a_server_of_another_method_says_so(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    with StubServer(connector=True, connector_method="kvcmas") as stub:
        result = CliRunner().invoke(main, ["replay", "--model", str(tiny_tokenizer_dir), "--method", "fullshared",
                                           "--base-url", stub.base_url, "--num-trajectories", "1",
                                           "--shared-tokens", "32", "--output-len", "2",
                                           "--result-dir", str(tmp_path / "r")], prog_name="kvbench")
        assert stub.rpc_calls == [WorkerRpc.INFO]  # nothing reset or sent before the check
    assert result.exit_code == 1, result.output
    assert "runs method 'kvcmas', not 'fullshared'" in result.output and "Traceback" not in result.output


def test_register_checks_what_it_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_METHODS", dict(registry.all_methods()))
    with pytest.raises(TypeError, match="needs a MethodSpec"):
        registry.register(dict)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sets `name` and a one-line `summary`"):
        MethodSpec(name="no-summary", summary="", implementation="x:Y")
    with pytest.raises(TypeError, match="implementation must be 'package.module:Class'"):
        MethodSpec(name="dotless", summary="s", implementation="x.Y")
    with pytest.raises(TypeError, match="threshold 'nope' is not one of its parameters"):
        MethodSpec(name="t", summary="s", implementation="x:Y", threshold_name="nope")
    taken = MethodSpec(name="fullshared", summary="another fullshared", implementation="elsewhere:FullShared")
    with pytest.raises(ValueError, match="method name 'fullshared' is taken by kvbench.methods.fullshared:FullShared"):
        registry.register(taken)
    with pytest.raises(ValueError, match="unknown method 'telepathy'; available: cacheblend, droidspeak"):
        registry.method_spec("telepathy")


def test_every_spec_names_its_implementation_and_matches_it() -> None:
    """What the client reads (the spec) is what the worker runs: each implementation's class
    carries its spec's name and flags."""
    for name, spec in registry.all_methods().items():
        cls = registry.method_class(name)
        assert cls.spec is spec and cls.name == name and cls.Params is spec.Params
        assert (cls.approximate, cls.uses_connector, cls.needs_adapters) == \
            (spec.approximate, spec.uses_connector, spec.needs_adapters)


def test_an_implementation_that_cannot_be_loaded_is_named() -> None:
    with pytest.raises(MethodConfigError, match="cannot load the method implementation 'kvbench.nowhere:X'"):
        load_implementation("kvbench.nowhere:X")
    with pytest.raises(MethodConfigError, match="is not a SharingMethod subclass"):
        load_implementation("kvbench.methods.api.spec:MethodSpec")


def test_the_claim_policy_crosses_the_boundary() -> None:
    """The method decides by default; "all" and "none" are kept as sent (what they do: the
    scheduler's tests in test_connector_units.py)."""
    for claim in ("method", "all", "none"):
        plan = Plan("t", "A0.r0", "A0", "k0", (PlanSegment("ph", "q", 10, 64),), claim=claim)
        assert Plan.from_params(plan.to_params()) == plan
    assert Plan.from_dict({"version": CONTRACT_VERSION}).claim == "method"
