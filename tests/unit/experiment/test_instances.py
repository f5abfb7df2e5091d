"""Several instances (`--instances N`, kvbench.server.instances): each on its own devices, all on one
Mooncake master started for the run, and nothing left running however the run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.server import lifecycle
from kvbench.server.config import ServerConfig
from kvbench.server.errors import ServerError
from kvbench.server.instances import InstancePlan, ServerGroup, instance_devices


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone too
        return stat.read().split()[2] != "Z"


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    return not _alive(pid)


def test_instances_split_the_cores_or_the_gpus(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2, 3, 4})
    assert instance_devices(2, 1) == [[0, 1], [2, 3, 4]]
    assert instance_devices(2, 2, gpus=4) == [[0, 1], [2, 3]]
    with pytest.raises(ServerError, match="3 instances of 2 CPU worker"):
        instance_devices(3, 2)
    with pytest.raises(ServerError, match="need 4 GPUs; 2 visible"):
        instance_devices(2, 2, gpus=2)


class FakeServer:
    """VLLMServer's start and stop, without vLLM (records what it was started with)."""

    started: list[FakeServer] = []
    fail_index: int | None = None

    def __init__(self, config: ServerConfig) -> None:
        self.config, self.stopped, self.process = config, False, None
        self.base_url = f"http://fake-{len(FakeServer.started)}"
        FakeServer.started.append(self)

    def launch(self) -> FakeServer:
        return self

    def await_ready(self) -> FakeServer:
        if FakeServer.fail_index is not None and self is FakeServer.started[FakeServer.fail_index]:
            raise ServerError("instance did not start")
        return self

    def command(self) -> list[str]:
        return ["vllm"]

    def failure(self) -> None:
        return None

    def stop_in_background(self) -> None:
        self.stopped = True


@pytest.fixture
def fake_servers(monkeypatch):
    pytest.importorskip("mooncake.store", reason="the [mooncake] extra (scripts/install.sh installs it)")
    FakeServer.started, FakeServer.fail_index = [], None
    monkeypatch.setattr(lifecycle, "VLLMServer", FakeServer)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})
    return FakeServer


def test_a_group_starts_its_master_and_instances_and_stops_them_all(fake_servers, tmp_path: Path) -> None:
    config = ServerConfig(model="m", kv_transfer_config={"kv_connector": "KVBenchConnector"})
    with ServerGroup(config, InstancePlan(instances=2, segment_bytes=1 << 20), tmp_path) as group:
        master = group.master
        assert master is not None and master.pid is not None and _alive(master.pid)
        configs = [server.config for server in fake_servers.started]
        assert [c.devices for c in configs] == [[0], [1]]
        assert {c.shared_tier.master for c in configs} == {master.address.master}  # type: ignore[union-attr]
        assert [c.log_path for c in configs] == [tmp_path / "server-0.log", tmp_path / "server-1.log"]
        assert group.describe()["shared_tier"]["master_pid"] == master.pid  # type: ignore[index]
        assert group.tier_url is not None and group.pids[group.tier_url] == master.pid
    assert all(server.stopped for server in fake_servers.started) and _wait_gone(master.pid)


def test_a_failed_instance_stops_the_others_and_the_master(fake_servers, tmp_path: Path) -> None:
    fake_servers.fail_index = 1
    group = ServerGroup(ServerConfig(model="m", kv_transfer_config={}), InstancePlan(instances=2), tmp_path)
    with pytest.raises(ServerError, match="instance did not start"):
        group.start()
    assert group.master is not None and group.master.pid is not None and _wait_gone(group.master.pid)
    assert all(server.stopped for server in fake_servers.started)


def test_one_instance_on_a_given_master_keeps_its_port_and_says_how_it_is_reached(fake_servers, tmp_path: Path) -> None:
    """`kvbench serve --port 8000 --mooncake-master ... --mooncake-local-hostname B` on one node of two."""
    from kvbench.cli.instance_options import instance_plan

    plan = instance_plan(1, True, "a:50051", "http://a:8080/metadata", 1 << 20, "10.0.0.2", "rdma")
    assert plan.grouped
    group = ServerGroup(ServerConfig(model="m", port=8000, kv_transfer_config={}), plan, tmp_path)
    (config,) = group.configs()
    assert config.port == 8000 and config.devices == [0, 1] and group.master is None
    assert config.shared_tier is not None and (config.shared_tier.master, config.shared_tier.local_hostname,
                                               config.shared_tier.protocol) == ("a:50051", "10.0.0.2", "rdma")


def test_plain_vllm_instances_share_no_tier(fake_servers, tmp_path: Path) -> None:
    with ServerGroup(ServerConfig(model="m"), InstancePlan(instances=2), tmp_path) as group:
        assert group.master is None and all(s.config.shared_tier is None for s in fake_servers.started)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_no_master_outlives_a_stopped_kvbench(signum: int) -> None:
    pytest.importorskip("mooncake.store", reason="the [mooncake] extra (scripts/install.sh installs it)")
    script = ("import time\nfrom kvbench.server.mooncake_master import MooncakeMaster\n"
              "with MooncakeMaster() as master:\n    print(master.pid, flush=True)\n    time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    pid = int(child.stdout.readline())
    assert _alive(pid)
    child.send_signal(signum)
    child.wait(timeout=20)
    assert _wait_gone(pid), f"mooncake_master {pid} outlived kvbench stopped by {signal.Signals(signum).name}"


def test_instance_flags_are_checked_before_anything_starts(tmp_path: Path) -> None:
    half = CliRunner().invoke(main, ["replay", "--instances", "2", "--mooncake-master", "h:1"])
    assert half.exit_code == 2 and "--mooncake-master and --mooncake-metadata go together" in half.output
    both = CliRunner().invoke(main, ["replay", "--instances", "2", "--base-url", "http://x"])
    assert both.exit_code == 2 and "give --instances, or --base-url/--port" in both.output


def test_an_instance_runs_on_its_own_cores_and_hands_the_connector_its_tier(monkeypatch) -> None:
    from kvbench.methods.core.mooncake_tier import SharedTierSettings

    monkeypatch.setattr(lifecycle, "_has_cuda", lambda: False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    tier = SharedTierSettings(master="h:1", metadata="http://h:2/metadata")
    server = lifecycle.VLLMServer(ServerConfig(model="m", port=1, devices=[1], shared_tier=tier,
                                               kv_transfer_config={"kv_connector_extra_config": {"method": "x"}}))
    env = server.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    command = server.command()
    extra = json.loads(command[command.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {"method": "x", "shared_tier": tier.to_dict()}


def test_a_sweep_runs_each_method_configuration_on_its_instances(fake_servers, tmp_path: Path, monkeypatch,
                                                                 tiny_tokenizer_dir: Path) -> None:
    from kvbench.experiment import sweep_runner

    seen: list[tuple[str, list[str], str, bool]] = []

    def fake_replay(spec, cell, server, inputs, after_cell=None, params=None) -> None:
        master = server.master
        seen.append((cell.method.name, server.base_urls, spec.routing, master is not None and _alive(master.pid)))

    monkeypatch.setattr(sweep_runner, "replay_cell", fake_replay)
    result = CliRunner().invoke(main, ["sweep", "-o", str(tmp_path / "s"), "--methods", "fullshared", "--instances", "2",
                                       "--routing", "agent", "--shared-tokens", "64", "--output-len", "4",
                                       "--num-trajectories", "2", "--model", str(tiny_tokenizer_dir)])
    assert result.exit_code == 0, result.output
    assert seen == [("fullshared", ["http://fake-0", "http://fake-1"], "agent", True)]
    assert all(server.stopped for server in fake_servers.started)


class StubInstance(FakeServer):
    """A VLLMServer stand-in serving kvbench's stand-in server (replay/stub.py), reporting the shared
    tier it was started with, as a connector server does."""

    started: list[StubInstance] = []  # type: ignore[assignment]

    def __init__(self, config: ServerConfig) -> None:  # (not FakeServer's: it has a real URL)
        from kvbench.replay.stub import StubServer

        tier = config.shared_tier.to_dict() if config.shared_tier is not None else None
        self.config, self.stub = config, StubServer(connector=True, shared_tier=tier)
        self.process = SimpleNamespace(pid=os.getpid())
        StubInstance.started.append(self)

    @property
    def base_url(self) -> str:
        return self.stub.base_url

    def launch(self) -> StubInstance:
        self.stub.start()
        return self

    def await_ready(self) -> StubInstance:
        return self

    def stop_in_background(self) -> None:
        self.stub.stop()


def test_replay_on_two_instances_reads_sources_across_them(monkeypatch, tmp_path: Path,
                                                           tiny_tokenizer_dir: Path) -> None:
    """`kvbench replay --instances 2 --routing agent`: a master and two instances started, each
    reader's plan naming its source on the other instance, config.json saying so, nothing left."""
    from kvbench.contracts import Plan

    pytest.importorskip("mooncake.store", reason="the [mooncake] extra (scripts/install.sh installs it)")
    StubInstance.started = []
    monkeypatch.setattr(lifecycle, "VLLMServer", StubInstance)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})
    run = tmp_path / "run"
    result = CliRunner().invoke(main, ["replay", "--model", str(tiny_tokenizer_dir), "--method", "fullshared", "--qps",
                                       "0", "--num-trajectories", "2", "--shared-tokens", "64", "--output-len", "4",
                                       "--instances", "2", "--routing", "agent", "--result-dir", str(run)])
    assert result.exit_code == 0, result.output
    config = json.loads((run / "config.json").read_text())
    urls = [instance.base_url for instance in StubInstance.started]
    assert config["instances"] == 2 and config["base_urls"] == urls and config["shared_tier_readable"] is True
    assert config["instance_devices"] == [[0], [1]]
    master_pid = config["shared_tier"]["master_pid"]
    assert master_pid in config["server_pids"].values() and _wait_gone(master_pid)
    requests = pd.read_parquet(run / "requests.parquet")
    where = {(r.trajectory_id, r.turn_id): r.server_url for r in requests.itertuples()}
    bodies = {rid: body for instance in StubInstance.started for rid, body in instance.stub.bodies.items()}
    crossing = 0
    for row in requests.itertuples():
        plan = Plan.from_params(bodies[row.request_id]["kv_transfer_params"])
        crossing += any(where[(row.trajectory_id, s.source_turn)] != row.server_url for s in plan.segments if s.source_turn)
    assert crossing == len(requests) - 2  # every reader's source is on the other instance, and named
