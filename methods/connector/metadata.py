"""What the scheduler side hands the worker side each engine step, and back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvbench.methods.connector.specs import LoadSpec, SaveSpec


@dataclass
class KVBenchMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    scheduled_req_ids: frozenset[str] = frozenset()  # the requests this engine step computes


@dataclass
class KVBenchWorkerMetadata(KVConnectorWorkerMetadata):
    saved_keys: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVBenchWorkerMetadata:
        if not isinstance(other, KVBenchWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into kvbench worker metadata")
        # Tensor-parallel ranks save their own heads under the same key.
        return KVBenchWorkerMetadata(self.saved_keys | other.saved_keys)
