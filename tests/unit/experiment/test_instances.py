"""Several instances (`--instances N`, kvbench.server.instances): each on its own devices, all on one
Mooncake master started for the run, and nothing left running however the run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
