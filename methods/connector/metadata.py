"""What the scheduler side hands the worker side each engine step, and back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvbench.methods.connector.specs import DecideSpec, LoadSpec, SaveSpec


@dataclass
class KVBenchMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    decides: list[DecideSpec] = field(default_factory=list)
    scheduled_req_ids: frozenset[str] = frozenset()  # the requests this engine step computes
    # Requests the connector follows whose prompt this step's forward finishes computing, with
    # every block they hold: after the forward their rows are final (read in wait_for_save).
    prefilled: dict[str, list[int]] = field(default_factory=dict)
    # Whether this step computes prompt tokens of any request (a prefill's first token waits for
    # the step): the method's deferred work then waits for a step without one.
    prefilling: bool = False
    # Prompts this step's forward finishes, of requests a concurrent turn may read
    # (Plan.readable_after_prefill): copied into the store after the forward, in wait_for_save.
    prompt_saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class KVBenchWorkerMetadata(KVConnectorWorkerMetadata):
    saved_keys: set[str] = field(default_factory=set)
    # request -> the rows [0, stop) the connector materializes for it, decided this step (DecideSpec)
    claims: dict[str, int] = field(default_factory=dict)
    # key -> the prompt rows saved this step ahead of the request's end (KVBenchMetadata.prompt_saves)
    prompt_saved: dict[str, int] = field(default_factory=dict)
    # agent -> the share of its eligible rows its turn finished this step reused (how a method
    # that decides first chooses to claim that agent's next turn directly)
    reuse_shares: dict[str, float] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVBenchWorkerMetadata:
        if not isinstance(other, KVBenchWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into kvbench worker metadata")
        # Tensor-parallel ranks save their own heads under the same key, and decide alike (their
        # decisions come from sums over ranks); the smaller claim is the safe one should they not.
        # Likewise the smaller figure of saved prompt rows and of reused shares.
        return KVBenchWorkerMetadata(self.saved_keys | other.saved_keys, _smaller(self.claims, other.claims),
                                     _smaller(self.prompt_saved, other.prompt_saved),
                                     _smaller(self.reuse_shares, other.reuse_shares))


N = TypeVar("N", int, float)


def _smaller(ours: dict[str, N], theirs: dict[str, N]) -> dict[str, N]:
    """Both ranks' keys, each with the smaller of its values where both report it."""
    merged = dict(ours)
    for key, value in theirs.items():
        merged[key] = min(value, merged.get(key, value))
    return merged
