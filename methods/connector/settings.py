"""The connector's settings (`kv_connector_extra_config`) and the method they name."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

from kvbench.methods.api.base import MethodConfigError, SharingMethod, load_implementation
from kvbench.methods.core.mooncake_tier import SharedTierSettings

DEFAULT_MAX_STORE_BYTES = 4 << 30
FAULT_MODES = ("all", "flagged", "flagged_nonfinite_rank0")


def fault_fraction(mode: Any) -> float | None:
    """The share of loads a `fault_injection` fraction fails (None: not a fraction)."""
    try:
        fraction = float(mode)
    except (TypeError, ValueError):
        return None
    return fraction if 0 < fraction <= 1 else None


def fault_hash(key: str) -> float:
    """A request key's place in [0, 1): which loads a fault fraction fails, alike on every rank."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def load_method(settings: ConnectorSettings) -> SharingMethod:
    """The method the settings name, built from its implementation's dotted path (no registry
    lookup in the workers: what the client resolved is what runs)."""
    cls = load_implementation(settings.implementation)
    if cls.name != settings.method:
        raise MethodConfigError(f"{settings.implementation} implements {cls.name!r}, not {settings.method!r}")
    try:
        return cls(settings.params)
    except ValueError as exc:
        raise MethodConfigError(str(exc)) from None


@dataclass
class ConnectorSettings:
    method: str
    implementation: str  # the method's class, "package.module:Class" (its spec's)
    params: dict[str, Any]
    max_store_bytes: int
    # Tests of the dense fallback: "all" raises inside every load, a fraction (e.g. "0.25") inside
    # that share of the loads (picked by a hash of the request's key: the same on every
    # tensor-parallel rank, and from run to run), "flagged" inside loads whose plan has
    # inject_fault; "flagged_nonfinite_rank0" makes such loads place a non-finite value on
    # tensor-parallel rank 0 only (every rank must still fall back together).
    fault_injection: str | None
    # 0: a request's cache is materialized in the engine step that schedules it (vLLM's sync
    # load). N > 0: loads are asynchronous and each engine step runs partial-forward layers of the
    # waiting loads, the one with the least work left first, until about N tokens' worth of rows
    # went through all layers (at least one layer per step), so one long load cannot stall the
    # batch for long, nor hold up the short loads queued behind it.
    max_load_tokens_per_step: int = 0
    # The LoRA adapters the server serves (name -> PEFT folder), which the connector applies to the
    # rows it computes itself and PReCache's methods rebuild values with (kvbench.methods.core.lora).
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)
    # What a row the connector's partial forward computes costs against a row vLLM prefills, for a
    # method that decides before its claim (SharingMethod.decides_before_claim): the claim stops
    # where the rows it would compute cost more than the rows it reuses save, and vLLM prefills
    # the rest. 1.5: measured on the CPU backend (benchmarks/bench_cold_start.py).
    connector_row_cost: float = 1.5
    # Deciding first costs an engine step: such a method claims an agent's turn directly (deciding
    # inside the load, computing what it sends dense itself) while that agent's last turn reused at
    # least this share of its eligible rows (the steady state), and decides first otherwise (a
    # cold start, or a gate that sends context dense). Above 1: always decides first.
    direct_claim_share: float = 0.75
    # A shared tier under the segment store, in Mooncake Store (None: caches stay in this instance).
    shared_tier: SharedTierSettings | None = None

    @property
    def asynchronous(self) -> bool:
        return self.max_load_tokens_per_step > 0

    def fails_load(self, key: str, flagged: bool) -> bool:
        """Whether fault injection fails the load of request `key` (plan flagged or not)."""
        fault = self.fault_injection
        fraction = fault_fraction(fault)
        return (fault == "all" or (fault == "flagged" and flagged)
                or (fraction is not None and fault_hash(key) < fraction))

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {"method", "implementation", "params", "max_store_bytes", "fault_injection", "max_load_tokens_per_step",
                 "adapters", "connector_row_cost", "direct_claim_share", "shared_tier"}
        if unknown := set(extra) - known:
            raise MethodConfigError(f"unknown kv_connector_extra_config key(s): {', '.join(sorted(unknown))}")
        if "method" not in extra or "implementation" not in extra:
            raise MethodConfigError("kv_connector_extra_config needs 'method' and 'implementation' (its class, "
                                    "'package.module:Class'; kvbench.methods.registry.kv_transfer_config writes both)")
        max_bytes = int(extra.get("max_store_bytes", DEFAULT_MAX_STORE_BYTES))
        if max_bytes <= 0:
            raise MethodConfigError(f"max_store_bytes must be > 0, got {max_bytes}")
        fault = extra.get("fault_injection")
        if fault is not None and fault not in FAULT_MODES and fault_fraction(fault) is None:
            raise MethodConfigError(f"fault_injection must be 'all', a fraction in (0, 1] of the loads, 'flagged', "
                                    f"'flagged_nonfinite_rank0' or absent, got {fault!r}")
        budget = extra.get("max_load_tokens_per_step", 0)
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise MethodConfigError(f"max_load_tokens_per_step must be an integer >= 0, got {budget!r}")
        adapters = extra.get("adapters") or {}
        if not isinstance(adapters, dict) or not all(isinstance(v, str) for v in adapters.values()):
            raise MethodConfigError(f"adapters must map adapter names to PEFT folders, got {adapters!r}")
        row_cost = extra.get("connector_row_cost", 1.5)
        if isinstance(row_cost, bool) or not isinstance(row_cost, int | float) or not 0 < row_cost < float("inf"):
            raise MethodConfigError(f"connector_row_cost must be a number > 0, got {row_cost!r}")
        direct = extra.get("direct_claim_share", 0.75)
        if isinstance(direct, bool) or not isinstance(direct, int | float) or not 0 <= direct < float("inf"):
            raise MethodConfigError(f"direct_claim_share must be a number >= 0, got {direct!r}")
        try:
            shared = None if extra.get("shared_tier") is None else SharedTierSettings.from_dict(extra["shared_tier"])
        except (TypeError, ValueError) as exc:
            raise MethodConfigError(str(exc)) from None
        return cls(str(extra["method"]), str(extra["implementation"]), dict(extra.get("params") or {}), max_bytes,
                   fault, budget, dict(adapters), float(row_cost), float(direct), shared)
