"""The per-request plan the replayer sends in `kv_transfer_params["kvbench"]` (workload facts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLAN_KEY = "kvbench"


@dataclass(frozen=True)
class PlanSegment:
    kind: str  # "pf" | "ph"
    id: str
    start: int
    length: int
    source: str | None = None  # cache key of the turn whose cache holds this PH segment
    source_start: int | None = None
    source_agent: str | None = None  # the agent of that turn (the edge source_agent -> plan.agent)


@dataclass(frozen=True)
class Plan:
    trajectory: str
    turn: str
    agent: str
    save_as: str | None
    segments: tuple[PlanSegment, ...]
    # False: vLLM prefills the request itself and the connector only saves its cache (e.g. a
    # dense reference for measuring KV error).
    claim: bool = True
    inject_fault: bool = False  # honoured only with kv_connector_extra_config.fault_injection="flagged"

    @property
    def sources(self) -> set[str]:
        return {s.source for s in self.segments if s.source}


def parse_plan(kv_transfer_params: dict[str, Any] | None) -> Plan | None:
    """None for requests without a kvbench plan (served as plain vLLM requests)."""
    raw = (kv_transfer_params or {}).get(PLAN_KEY)
    if not raw:
        return None
    segments = tuple(
        PlanSegment(kind=s["kind"], id=s["id"], start=int(s["start"]), length=int(s["length"]),
                    source=s.get("source"),
                    source_start=None if s.get("source_start") is None else int(s["source_start"]),
                    source_agent=s.get("source_agent"))
        for s in raw.get("segments", [])
    )
    return Plan(trajectory=str(raw.get("trajectory", "")), turn=str(raw.get("turn", "")),
                agent=str(raw.get("agent", "")), save_as=raw.get("save_as"), segments=segments,
                claim=bool(raw.get("claim", True)), inject_fault=bool(raw.get("inject_fault", False)))
