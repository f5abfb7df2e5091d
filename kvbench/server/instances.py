"""Several vLLM instances of one configuration (`--instances N`), each on its own share of the
machine, and the Mooncake master their shared tier runs through: started together, stopped
together however the run ends (no process left behind)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from kvbench.server import lifecycle
from kvbench.server.config import ServerConfig, tensor_parallel_size
from kvbench.server.errors import ServerError
from kvbench.server.mooncake_master import MasterAddress, MooncakeMaster

DEFAULT_SEGMENT_BYTES = 1 << 30  # what each worker lends the shared tier (allocated as it fills)


def instance_devices(instances: int, ranks: int, gpus: int | None = None) -> list[list[int]]:
    """Each instance's devices: `ranks` GPUs each where there are `gpus`, else contiguous shares of
    this process's CPU cores (at least one per rank)."""
    if instances < 1:
        raise ServerError(f"--instances must be >= 1, got {instances}")
    if gpus is not None:
        if gpus < instances * ranks:
            raise ServerError(f"{instances} instances of {ranks} GPU(s) each need {instances * ranks} GPUs; "
                              f"{gpus} visible")
        return [list(range(i * ranks, (i + 1) * ranks)) for i in range(instances)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < instances * ranks:
        raise ServerError(f"{instances} instances of {ranks} CPU worker(s) each need {instances * ranks} cores; "
                          f"this process may use {len(cores)}")
    return [cores[len(cores) * i // instances: len(cores) * (i + 1) // instances] for i in range(instances)]


def _visible_gpus() -> int | None:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


@dataclass(frozen=True)
class InstancePlan:
    """How many instances serve a run and what they share: a Mooncake master started for the run
    (`shared`, no `master`), one given, or none (`shared=False`: each keeps its caches to itself)."""

    instances: int = 1
    shared: bool = True
    master: MasterAddress | None = None
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    # how the other instances reach this machine's share of the store (another node: its address)
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"  # Mooncake's transport: "rdma" between nodes that have it

    @property
    def grouped(self) -> bool:
        """Whether the run needs a group (several instances, or one on a given master)."""
        return self.instances > 1 or (self.shared and self.master is not None)


class ServerGroup:
    """`plan.instances` servers from one config, and their shared tier."""

    def __init__(self, config: ServerConfig, plan: InstancePlan, log_dir: Path) -> None:
        self.config, self.instances, self.log_dir = config, plan.instances, log_dir
        # plain vLLM has no segment store; one instance alone shares only with a given master
        self.shared = plan.shared and config.kv_transfer_config is not None and plan.grouped
        self.segment_bytes = plan.segment_bytes
        self.plan = plan
        self.master_address = plan.master
        self.master: MooncakeMaster | None = None
        self.servers: list[lifecycle.VLLMServer] = []

    @property
    def base_urls(self) -> list[str]:
        return [server.base_url for server in self.servers]

    @property
    def pids(self) -> dict[str, int]:
        """Each server's pid by URL, and the master's by its metrics page's (its memory is sampled too)."""
        pids = {server.base_url: server.process.pid for server in self.servers if server.process is not None}
        if self.tier_url is not None and self.master is not None and self.master.pid is not None:
            pids[self.tier_url] = self.master.pid
        return pids

    @property
    def tier_url(self) -> str | None:
        """The started master's metrics base URL (its /metrics: the store's memory); None otherwise."""
        url = self.master.address.metrics_url if self.master is not None else None
        return None if url is None else url.removesuffix("/metrics")

    def configs(self) -> list[ServerConfig]:
        devices = instance_devices(self.instances, tensor_parallel_size(self.config.extra_args), _visible_gpus())
        tier = None
        if self.shared and self.master_address is not None:
            tier = dataclasses.replace(self.master_address.tier_settings(self.segment_bytes, self.plan.local_hostname),
                                       protocol=self.plan.protocol)
        port = self.config.port if self.instances == 1 else None  # (several: each on a free port)
        return [dataclasses.replace(self.config, devices=devices[i], shared_tier=tier, port=port,
                                    log_path=self.log_dir / (f"server-{i}.log" if self.instances > 1 else "server.log"))
                for i in range(self.instances)]

    def start(self) -> ServerGroup:
        try:
            if self.shared and self.master_address is None:
                self.master = MooncakeMaster(log_path=self.log_dir / "mooncake_master.log").start()
                self.master_address = self.master.address
            self.servers = [lifecycle.VLLMServer(config) for config in self.configs()]
            for server in self.servers:
                server.launch()
            for server in self.servers:
                server.await_ready()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def base_url(self) -> str:
        """The first instance's URL (a single server's face; `base_urls` has them all)."""
        return self.servers[0].base_url

    def is_running(self) -> bool:
        return self.failure() is None

    def command(self) -> list[str]:
        """The instances' vLLM command (alike but for their ports)."""
        return self.servers[0].command()

    def failure(self) -> str | None:
        """Why the group cannot serve any more (an instance or the master gone), else None."""
        for index, server in enumerate(self.servers):
            if (why := server.failure()) is not None:
                return f"instance {index} ({server.base_url}): {why}"
        if self.master is not None and self.master.process is not None and self.master.process.poll() is not None:
            return f"mooncake_master exited with code {self.master.process.returncode} (log: {self.master.log_path})"
        return None

    def stop(self) -> None:
        """Every server (side by side), then the master."""
        try:
            for server in self.servers:
                server.stop_in_background()
            lifecycle.wait_for_stopped_servers()
        finally:
            if self.master is not None:
                self.master.stop()

    def describe(self) -> dict[str, object]:
        """For config.json: the instances and the shared tier."""
        address = self.master_address
        return {"instances": self.instances, "instance_devices": [s.config.devices for s in self.servers],
                "shared_tier": None if not self.shared or address is None else {
                    **dataclasses.asdict(address), "started_here": self.master is not None,
                    "master_pid": None if self.master is None else self.master.pid,
                    "segment_bytes": self.segment_bytes}}

    def __enter__(self) -> ServerGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
