"""Agents as LoRA adapters: the trace names each agent's adapter, replay serves and addresses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from peft_folders import v_only_peft

from kvbench.cli import main
from kvbench.methods.registry import resolve_method
from kvbench.server.config import lora_args
from kvbench.server.errors import ServerError
from kvbench.tracegen.trace_files import read_trace


def _peft(folder: Path, rank: int = 8) -> Path:
    return v_only_peft(folder, rank)


def _trace(tmp_path: Path, *adapters: str) -> Path:
    out = tmp_path / "t.jsonl"
    result = CliRunner().invoke(main, ["gen-trace", "-o", str(out), "--shared-tokens", "64", "--num-trajectories",
                                       "2", "--output-len", "4", "--qps", "0",
                                       *[a for spec in adapters for a in ("--adapter", spec)]])
    assert result.exit_code == 0, result.output
    return out


def test_agents_of_a_role_name_its_adapter_and_the_header_lists_it(tmp_path: Path) -> None:
    solver, critic = _peft(tmp_path / "solver-lora"), _peft(tmp_path / "critic lora", rank=16)
    trace = read_trace(_trace(tmp_path, f"Math Solver={solver}", f"Inspector={critic}"))
    assert trace.header.version == 2
    assert trace.header.adapters == {"solver-lora": str(solver), "critic-lora": str(critic)}
    agents = trace.trajectories[0].agents
    assert [agents[a].adapter for a in ("A0", "A1", "A2", "A3")] == ["solver-lora", None, None, "critic-lora"]


@pytest.mark.parametrize("spec, message", [
    ("Nobody={folder}", "no agent has role 'Nobody'"),
    ("Math Solver={tmp}/missing", "not a PEFT adapter folder"),
    ("Math Solver", "expected ROLE=PATH"),
])
def test_bad_adapter_requests_are_clear_errors(spec: str, message: str, tmp_path: Path) -> None:
    folder = _peft(tmp_path / "a")
    result = CliRunner().invoke(main, ["gen-trace", "-o", str(tmp_path / "t.jsonl"), "--shared-tokens", "64",
                                       "--adapter", spec.format(folder=folder, tmp=tmp_path)])
    assert result.exit_code != 0 and message in result.output, result.output


def test_lora_args_serve_every_adapter_at_a_rank_vllm_accepts(tmp_path: Path) -> None:
    modules = {"a": str(_peft(tmp_path / "a", rank=4)), "b": str(_peft(tmp_path / "b", rank=12))}
    assert lora_args(modules) == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                                  "--lora-modules", f"a={modules['a']}", f"b={modules['b']}"]
    with pytest.raises(ServerError, match="adapter 'c'.*not a PEFT adapter config"):
        lora_args({"c": str(tmp_path)})


def test_replay_sends_each_agent_to_its_adapter_and_refuses_a_server_without_it(tmp_path: Path) -> None:
    from kvbench.replay.stub import StubServer

    trace = _trace(tmp_path, f"Math Solver={_peft(tmp_path / 'solver')}")
    with StubServer() as stub:  # serves no adapter
        refused = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--base-url", stub.base_url, "--qps", "0",
                                            "--num-warmups", "0", "--result-dir", str(tmp_path / "refused")])
        assert not stub.bodies
    assert refused.exit_code != 0 and "does not serve adapter 'solver'" in refused.output
    assert "--lora-modules solver=" in refused.output and not (tmp_path / "refused" / "requests.parquet").exists()
    with StubServer(adapters=("solver",)) as stub:
        result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--base-url", stub.base_url, "--qps", "0",
                                           "--num-warmups", "0", "--result-dir", str(tmp_path / "run")])
        bodies = dict(stub.bodies)
    assert result.exit_code == 0, result.output
    models = {request_id.split("/")[-1]: body["model"] for request_id, body in bodies.items()}
    assert models == {"A0.r0": "solver", "A1.r0": "stub-model", "A2.r0": "stub-model", "A3.r0": "stub-model"}
    # the plan tells the connector which adapter reads and which one wrote each shared segment
    plans = {rid.split("/")[-1]: body["kv_transfer_params"]["kvbench"] for rid, body in bodies.items()}
    assert plans["A0.r0"]["adapter"] == "solver" and plans["A1.r0"]["adapter"] is None
    written = {s["source_turn"]: s["source_adapter"] for s in plans["A2.r0"]["segments"] if s["source_turn"]}
    assert written and written.get("A0.r0", "solver") == "solver" and written.get("A1.r0") is None


def test_built_adapters_are_v_only_deterministic_and_the_zero_one_is_zero(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from kvbench.model.adapters import build_random_adapter, v_only_problems, weights_sha256
    from kvbench.model.resolve import resolve_model

    base = resolve_model(None)
    first = build_random_adapter(base, tmp_path / "a", rank=4, seed=3)
    again = build_random_adapter(base, tmp_path / "b", rank=4, seed=3)
    other = build_random_adapter(base, tmp_path / "c", rank=4, seed=4)
    assert weights_sha256(first) == weights_sha256(again) != weights_sha256(other)
    assert v_only_problems(first) == []
    tensors = load_file(str(first / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 8 and tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"].shape == (128, 4)
    zero = load_file(str(build_random_adapter(base, tmp_path / "z", zero=True) / "adapter_model.safetensors"))
    assert all(not t.any() for name, t in zero.items() if "lora_B" in name)


def test_adapters_that_touch_more_than_the_values_are_named(tmp_path: Path) -> None:
    from kvbench.model.adapters import v_only_problems

    folder = _peft(tmp_path / "qv")
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj", "v_proj"]}))
    assert v_only_problems(folder) == [f"{folder}: target_modules ['q_proj', 'v_proj'] (PReCache needs exactly "
                                       "['v_proj'])"]


def test_model_adapters_prints_the_gen_trace_arguments(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["model", "adapters", "-o", str(tmp_path), "--agents", "2", "--rank", "4"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("--adapter"))
    assert line == (f'--adapter "Table Reader={tmp_path / "table-reader"}" '
                    f'--adapter "Link Follower={tmp_path / "link-follower"}"')


def test_route_adapters_follow_each_roles_reading_and_need_the_adapter_model(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["model", "adapters", "-o", str(tmp_path / "r"), "--model", "kvbench:roles-adapter",
                                       "--roles", "role-recall", "--kind", "route"])
    assert result.exit_code == 0, result.output
    readings = {p.name: json.loads((p / "kvbench-adapter.json").read_text())["reading"]
                for p in (tmp_path / "r").iterdir()}
    assert readings == {"route-planner": 0, "failover-officer": 1, "queue-router": 0, "recovery-lead": 1}
    refused = CliRunner().invoke(main, ["model", "adapters", "-o", str(tmp_path / "x"), "--roles", "role-recall",
                                        "--kind", "route"])  # the default model has no route to put in an adapter
    assert refused.exit_code != 0 and "roles-adapter" in refused.output
    refused = CliRunner().invoke(main, ["model", "adapters", "-o", str(tmp_path / "y"), "--model",
                                        "kvbench:roles-adapter", "--kind", "route"])  # recall roles follow no route
    assert refused.exit_code != 0 and "follows no route" in refused.output


def test_a_sweep_serves_its_traces_adapters_and_old_sweep_files_still_read(tmp_path: Path) -> None:
    from kvbench.experiment.sweep import MethodConfig, SweepSpec

    folder = _peft(tmp_path / "main-route")
    spec = SweepSpec(methods=[MethodConfig("precache-rebase")], task="role-recall", roles="role-recall-main",
                     adapters={"Route Planner": str(folder), "Queue Router": str(folder)})
    [trace_spec] = spec.trace_specs().values()
    assert trace_spec.roles == "role-recall-main" and trace_spec.adapters == spec.adapters
    stored = spec.to_json()
    del stored["roles"], stored["adapters"]  # a sweep.json written before adapters
    old = SweepSpec.from_json(stored)
    assert old.roles is None and old.adapters == {}
    assert next(iter(old.trace_specs().values())).roles == "role-recall"  # the task's preset


def test_a_connector_server_gives_its_adapters_to_the_connector(tmp_path: Path) -> None:
    from kvbench.server.config import method_server_config
    from kvbench.server.lifecycle import VLLMServer

    folder = _peft(tmp_path / "a")
    command = VLLMServer(method_server_config(resolve_method("precache-prelr"), "m", lora_modules={"a": str(folder)})).command()
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_extra_config"]["adapters"] == {"a": str(folder)}
    assert "--lora-modules" in command and f"a={folder}" in command


def test_precache_is_refused_for_a_trace_without_adapters(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--method", "precache-rebase",
                                       "--result-dir", str(tmp_path / "run")])
    assert result.exit_code != 0 and "use none" in result.output
    assert not (tmp_path / "run" / "requests.jsonl").exists()
