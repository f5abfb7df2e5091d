"""The options of a run on several vLLM instances (replay, serve, sweep): how many, and the
Mooncake Store their caches are shared through."""

from __future__ import annotations

from typing import Any

import click

from kvbench.cli.param_types import option_group
from kvbench.cli.server_options import ByteSize

_OPTIONS = [
    click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
                 help="vLLM instances to start, each on its own share of the machine (CPU cores, or GPUs: "
                      "--tensor-parallel-size each); --routing spreads the requests over them."),
    click.option("--shared-tier/--no-shared-tier", default=True, show_default=True,
                 help="With several instances, share saved caches through Mooncake Store (a source written on one "
                      "instance is read on another); --no-shared-tier: each instance keeps its own."),
    click.option("--mooncake-master", default=None, metavar="HOST:PORT",
                 help="A running mooncake_master's RPC address [default: start one for the run]."),
    click.option("--mooncake-metadata", default=None, metavar="URL",
                 help="Its metadata server (http://HOST:PORT/metadata); with --mooncake-master."),
    click.option("--shared-tier-bytes", type=ByteSize(), default="1GiB", show_default=True, metavar="SIZE",
                 help="Memory each instance's worker lends the shared tier (allocated as it fills)."),
    click.option("--mooncake-local-hostname", default="127.0.0.1", show_default=True, metavar="HOST",
                 help="How other nodes reach this one's share of the store (its address on their network)."),
    click.option("--mooncake-protocol", type=click.Choice(["tcp", "rdma"]), default="tcp", show_default=True,
                 help="Mooncake's transport between instances."),
]
_NAMES = ("instances", "shared_tier", "mooncake_master", "mooncake_metadata", "shared_tier_bytes",
          "mooncake_local_hostname", "mooncake_protocol")


def instance_plan(instances: int, shared_tier: bool, mooncake_master: str | None, mooncake_metadata: str | None,
                  shared_tier_bytes: int, mooncake_local_hostname: str = "127.0.0.1", mooncake_protocol: str = "tcp") -> Any:
    """The InstancePlan the options ask for; a UsageError for a half-given master."""
    from kvbench.server.instances import InstancePlan
    from kvbench.server.mooncake_master import MasterAddress

    if (mooncake_master is None) != (mooncake_metadata is None):
        raise click.UsageError("--mooncake-master and --mooncake-metadata go together (the master's RPC address "
                               "and its metadata URL)")
    master = None if mooncake_master is None else MasterAddress(mooncake_master, str(mooncake_metadata))
    return InstancePlan(instances=instances, shared=shared_tier, master=master, segment_bytes=shared_tier_bytes,
                        local_hostname=mooncake_local_hostname, protocol=mooncake_protocol)


# Adds the instance options to a click command, which receives them as one `instances` InstancePlan.
instance_options = option_group(_OPTIONS, _NAMES, instance_plan, "instances")
