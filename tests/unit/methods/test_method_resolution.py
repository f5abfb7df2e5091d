"""A command looks its method up once (issue 67): `--method NAME` becomes a ChosenMethod at the
CLI's edge, and the replay, the server's configuration and the connector's transfer
configuration take that, not the name."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.methods import registry
from kvbench.replay.stub import StubServer


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every registry lookup by name from now on."""
    calls: list[str] = []
    real = registry.method_spec
    monkeypatch.setattr(registry, "method_spec", lambda name: calls.append(name) or real(name))
    return calls


def test_a_replay_looks_its_method_up_once(small_trace, tmp_path: Path, lookups: list[str]) -> None:
    trace = small_trace(trajectories=2, shared_tokens=40, output_len=4)
    with StubServer(connector=True, connector_method="kvcmas") as stub:
        result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--method", "kvcmas", "--method-param",
                                           "V=3", "--base-url", stub.base_url, "--qps", "0",
                                           "--result-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert lookups == ["kvcmas"]


def test_the_servers_configuration_takes_the_resolved_method(lookups: list[str]) -> None:
    from kvbench.server.config import method_server_config

    chosen = registry.resolve_method("kvcmas", {"V": 3})
    config = method_server_config(chosen, "m", max_store_bytes=1 << 20)
    extra = config.kv_transfer_config["kv_connector_extra_config"]
    assert extra["method"] == "kvcmas" and extra["params"] == {"V": 3} and extra["max_store_bytes"] == 1 << 20
    assert method_server_config(registry.resolve_method("nonshared"), "m").kv_transfer_config is None
    assert lookups == ["kvcmas", "nonshared"]  # resolve_method's own, nothing after


def test_a_bad_parameter_is_refused_where_the_method_is_resolved() -> None:
    with pytest.raises(ValueError, match="unknown method 'kvcmass'"):
        registry.resolve_method("kvcmass")
    with pytest.raises(ValueError, match="V"):
        registry.resolve_method("kvcmas", {"V": -1})
    chosen = registry.resolve_method("kvcmas")
    with pytest.raises(ValueError):
        chosen.with_params({"tau": "high"})
    assert chosen.with_params({"tau": 0.3}).params == {"tau": 0.3}
