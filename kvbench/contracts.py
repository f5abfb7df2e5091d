"""What crosses a process boundary: between the replayer and the connector inside vLLM, and
between a sweep's driver and its cells on a cluster.

Four contracts, versioned together: the per-request plan (sent in `kv_transfer_params`), the
worker RPCs (vLLM's `/collective_rpc` into kvbench's worker extension), the stats those RPCs
return, and the events a sweep cell's Ray task sends its driver. Every side imports this module;
it imports neither vLLM, torch nor Ray. A change to any field here bumps CONTRACT_VERSION, and
each side checks the other's version before relying on a key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, Literal, TypedDict

# 6: CellTaskEvent (sweep cells as Ray tasks); 5: ServerInfo.shared_tier (instances sharing caches through Mooncake Store);
# 4: Plan.adapter and PlanSegment.source_adapter (agents as LoRA adapters); 3: Plan.keep_cache;
# 2: Plan.claim became a ClaimPolicy (was a bool meaning "all" / "none")
CONTRACT_VERSION = 6
PLAN_KEY = "kvbench"  # the plan's key in a request's kv_transfer_params


class ContractError(ValueError):
    """The replayer and the server disagree on a contract (another kvbench version, or a server
    running something else)."""


# ---------------------------------------------------------------------------------- the plan
SegmentKind = Literal["pf", "ph"]
# Which requests the connector claims (loads through its own partial forward):
# - "method": those its method reuses something for (SharingMethod.loads_request: by default, a
#   request with a shared segment that names a source cache); any other goes through vLLM's own
#   batched prefill, keeps its prefix-cache hits and is only saved, so a turn that reuses nothing
#   is NonShared in time and in outputs.
# - "all": every prompt token but the last (tests of the partial forward itself).
# - "none": never; the request is only saved (a dense reference for measuring KV error).
ClaimPolicy = Literal["method", "all", "none"]
CLAIM_POLICIES: tuple[ClaimPolicy, ...] = ("method", "all", "none")


@dataclass(frozen=True)
class PlanSegment:
    """One span of a prompt: a private prefix (pf) or a shared segment (ph)."""

    kind: SegmentKind
    id: str  # "system", "text", or the shared segment's key ("q", "out:A0.r0")
    start: int
    length: int
    source: str | None = None  # cache key of the turn whose cache holds this PH segment
    source_start: int | None = None  # where the segment starts in that cache
    source_turn: str | None = None  # that turn's id in the trace
    source_agent: str | None = None  # its agent (the edge source_agent -> plan.agent)
    source_adapter: str | None = None  # the LoRA adapter that wrote that cache (None: the base model)

    @classmethod
    def from_dict(cls, raw: Any) -> PlanSegment:
        if not isinstance(raw, dict):
            raise ContractError(f"a plan segment must be an object, got {type(raw).__name__}")
        if raw.get("kind") not in ("pf", "ph"):
            raise ContractError(f"a plan segment's kind must be 'pf' or 'ph', got {raw.get('kind')!r}")
        try:
            return cls(kind=raw["kind"], id=str(raw["id"]), start=int(raw["start"]), length=int(raw["length"]),
                       source=raw.get("source"),
                       source_start=None if raw.get("source_start") is None else int(raw["source_start"]),
                       source_turn=raw.get("source_turn"), source_agent=raw.get("source_agent"),
                       source_adapter=raw.get("source_adapter"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ContractError(f"bad plan segment {raw!r}: {type(exc).__name__}: {exc}") from None


@dataclass(frozen=True)
class Plan:
    """Workload facts of one request (never method parameters, which live in the server's
    connector config), so one trace replays against every method unchanged."""

    trajectory: str
    turn: str
    agent: str
    save_as: str | None  # the request's key: its stats, and where its cache is saved when it finishes
    segments: tuple[PlanSegment, ...] = ()
    claim: ClaimPolicy = "method"
    # Earlier caches of this trajectory that may hold the prompt's first rows exactly (the agent's
    # own earlier turns: its next round starts with its earlier prompt). The connector copies the
    # longest such prefix instead of computing it; they are never reused approximately.
    prefix_sources: tuple[str, ...] = ()
    inject_fault: bool = False  # honoured only with kv_connector_extra_config.fault_injection="flagged"
    # Whether the connector keeps the finished request's cache under `save_as`. False when no later
    # turn reads it (a trajectory's last agent): the copy into the store would only delay the next
    # engine step, which is often the next trajectory's first agent. Its stats are reported anyway.
    keep_cache: bool = True
    # The LoRA adapter this request runs with (its agent's; None: the base model). A cache written
    # under another adapter (PlanSegment.source_adapter) holds other values for the same tokens.
    adapter: str | None = None
    # Whether a turn running at the same time may read this request's prompt: the connector then
    # saves the prompt's rows as soon as the forward that finishes them has run, and such a reader
    # goes ahead then, without waiting for this request's decode (its output rows still come with
    # the whole save when it finishes). Added without a version bump: an older server ignores it,
    # and its readers then wait for the whole save.
    readable_after_prefill: bool = False
    # Sources sent just before this request by a turn running at the same time: they may reach
    # the engine after it, so the connector waits briefly for each to arrive (then for its prompt).
    sources_in_flight: tuple[str, ...] = ()
    version: int = CONTRACT_VERSION

    @property
    def sources(self) -> set[str]:
        """The caches its shared segments reuse."""
        return {s.source for s in self.segments if s.source}

    def claimed(self, method_loads: Callable[[Plan], bool]) -> bool:
        """Whether the connector claims this request under its claim policy, for a method that
        loads the requests `method_loads` accepts (SharingMethod.loads_request)."""
        return method_loads(self) if self.claim == "method" else self.claim == "all"

    @property
    def saved_key(self) -> str | None:
        """The key its cache is kept under when it finishes (None: not kept)."""
        return self.save_as if self.keep_cache else None

    @property
    def exact_sources(self) -> set[str]:
        """Caches whose first rows may be copied as a dense prefill's: the agent's own earlier
        turns, and sources written under this request's adapter (another's values differ)."""
        return set(self.prefix_sources) | {s.source for s in self.segments
                                           if s.source and s.source_adapter == self.adapter}

    @property
    def waits_for(self) -> set[str]:
        """Every cache the request reads, each saved before its load starts."""
        return self.sources | set(self.prefix_sources)

    def rows_read_from(self, key: str) -> int | None:
        """How many of the first rows of cache `key` this request reads (its segments' source spans
        end there); None where it may read all of them (an exact-prefix source, whose copy may run
        into the output rows)."""
        if key in self.prefix_sources:
            return None
        ends = [s.source_start + s.length for s in self.segments if s.source == key and s.source_start is not None]
        return max(ends) if ends else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["segments"] = [asdict(s) for s in self.segments]
        return out

    def to_params(self) -> dict[str, Any]:
        """The request's `kv_transfer_params`."""
        return {PLAN_KEY: self.to_dict()}

    @classmethod
    def from_dict(cls, raw: Any) -> Plan:
        if not isinstance(raw, dict):
            raise ContractError(f"a kvbench plan must be an object, got {type(raw).__name__}")
        if raw.get("version") != CONTRACT_VERSION:
            raise ContractError(f"plan version {raw.get('version')!r}, this kvbench reads version {CONTRACT_VERSION}: "
                                "the replayer and the server run different kvbench versions")
        segments = raw.get("segments", [])
        if not isinstance(segments, list):
            raise ContractError("a kvbench plan's segments must be a list")
        claim = raw.get("claim", "method")
        if claim not in CLAIM_POLICIES:
            raise ContractError(f"a kvbench plan's claim must be one of {', '.join(CLAIM_POLICIES)}, got {claim!r}")
        return cls(trajectory=str(raw.get("trajectory", "")), turn=str(raw.get("turn", "")),
                   agent=str(raw.get("agent", "")), save_as=raw.get("save_as"),
                   segments=tuple(PlanSegment.from_dict(s) for s in segments),
                   claim=claim, prefix_sources=tuple(str(k) for k in raw.get("prefix_sources") or ()),
                   inject_fault=bool(raw.get("inject_fault", False)), keep_cache=bool(raw.get("keep_cache", True)),
                   adapter=raw.get("adapter"), readable_after_prefill=bool(raw.get("readable_after_prefill", False)),
                   sources_in_flight=tuple(str(k) for k in raw.get("sources_in_flight") or ()))

    @classmethod
    def from_params(cls, kv_transfer_params: dict[str, Any] | None) -> Plan | None:
        """The plan in a request's `kv_transfer_params`; None for requests without one (plain
        vLLM requests)."""
        raw = (kv_transfer_params or {}).get(PLAN_KEY)
        return cls.from_dict(raw) if raw else None


# ---------------------------------------------------------------------------------- worker RPCs
class WorkerRpc(StrEnum):
    """Methods of kvbench's vLLM worker extension, called over `/collective_rpc` (arguments are
    strings: the endpoint passes JSON kwargs through)."""

    INFO = "kvbench_info"  # -> ServerInfo: what the server runs
    ATTACH_MODEL = "kvbench_attach_model"  # hand the loaded model to the connector (idempotent)
    STATS = "kvbench_stats"  # (clear) -> WorkerStats
    SET_PARAMS = "kvbench_set_params"  # (params: JSON object) -> the method's parameters
    RESET = "kvbench_reset"  # (keep_method_state) -> True
    KV_ERROR = "kvbench_kv_error"  # (key, reference, start, stop) -> per-layer normalized error
    SAVED_ROWS = "kvbench_saved_rows"  # (key, layer, start, stop) -> K/V rows of a saved cache
    # (request: FidelityRequest JSON) -> SegmentFidelity: one shared segment's dense caches in two
    # agents' contexts compared (spectra, reuse error, selection coverage); added without a version
    # bump (no existing field changed): an older server answers it with an unknown-method error
    SEGMENT_FIDELITY = "kvbench_segment_fidelity"
    # (reset) -> DeviceMemory: what the worker's device holds; added without a version bump, as above
    MEMORY = "kvbench_memory"


@dataclass(frozen=True)
class DeviceMemory:
    """One worker's memory as the KVCMAS paper counts it (WorkerRpc.MEMORY): on a GPU the peak of
    torch's allocated bytes since the last reset (model, KV pool, method state and every temporary
    buffer); on any device the parts measured from their tensors. Method state and the saved-cache
    store come with WorkerStats."""

    device: str  # "cuda", "cpu", ...
    peak_allocated_bytes: int | None  # torch's peak since the reset; None where torch keeps none (CPU)
    weights_bytes: int  # the model's weights (methods/core/device_memory.py: loaded_weights_bytes)
    kv_pool_bytes: int  # vLLM's KV cache tensors (each storage once)
    contract_version: int = CONTRACT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> DeviceMemory:
        return cls(**_checked(cls, raw, WorkerRpc.MEMORY))


@dataclass(frozen=True)
class FidelityRequest:
    """One shared segment, prefilled densely in the target's prompt and in its source's cache (the
    source turn's prompt and output), compared inside the worker (WorkerRpc.SEGMENT_FIDELITY)."""

    target_tokens: list[int]
    target_start: int
    length: int
    source_tokens: list[int]
    source_start: int
    check_layer: int  # where the token criteria are measured (CacheBlend's check layer)
    recompute_tokens: int  # the token criteria's budget: tokens recomputed in every layer
    query_tail: int = 10  # the target prompt's last rows whose attention ranks tokens (RelayCaching)
    version: int = CONTRACT_VERSION

    def to_json(self) -> str:
        import json

        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FidelityRequest:
        import json

        raw = json.loads(text)
        if raw.get("version") != CONTRACT_VERSION:
            raise ContractError(f"fidelity request version {raw.get('version')!r}, this kvbench reads {CONTRACT_VERSION}")
        try:
            request = cls(**raw)
        except TypeError as exc:
            raise ContractError(f"bad fidelity request: {exc}") from None
        if not (0 <= request.target_start and request.target_start + request.length <= len(request.target_tokens)
                and 0 <= request.source_start and request.source_start + request.length <= len(request.source_tokens)):
            raise ContractError(f"fidelity request: the segment [{request.target_start}, +{request.length}) or "
                                f"[{request.source_start}, +{request.length}) lies outside its prompt")
        return request


class LayerFidelity(TypedDict):
    """One layer of a SegmentFidelity: singular values of the reused (source, re-aligned) rows and
    of the correction target - reused, keys and values over [tokens, heads x head_dim] of this
    rank's heads; and this rank's share of the squared reuse error and target norm."""

    k_base_sv: list[float]
    v_base_sv: list[float]
    k_delta_sv: list[float]
    v_delta_sv: list[float]
    k_sq_err: float
    k_sq_ref: float
    v_sq_err: float
    v_sq_ref: float


class SegmentFidelity(TypedDict):
    """Answer of WorkerRpc.SEGMENT_FIDELITY (one per worker). Error energies are each layer's K and
    V squared reuse errors over that layer's squared target norm (all ranks), summed: `layer_error`
    per layer; `*_removed` the part of their total that the token criteria's chosen tokens hold."""

    layers: list[LayerFidelity]
    layer_error: list[float]
    deviation_removed: float
    attention_removed: float
    tokens: int
    feature_dim: int  # heads x head_dim of this rank: the spectra's full rank
    recompute_tokens: int
    contract_version: int


# ---------------------------------------------------------------------------------- stats
class SegmentDecision(TypedDict, total=False):
    id: str
    source: str | None
    reused: int


class LoadStats(TypedDict, total=False):
    """What the connector records per request (by its plan's `save_as`). The first five keys
    are what the replayer's records take; methods add their own (gate decisions, `blend`...)."""

    reused_tokens: int  # rows served from a source (whole-token units)
    recomputed_tokens: int  # rows computed by the partial forward
    served_entries: int  # (token, layer) entries of reused rows served from reuse (the recompute share's)
    layers: int
    eligible_tokens: int  # rows a source held with identical tokens
    source_missing_tokens: int  # rows whose named source the store no longer held
    ph_without_source_tokens: int
    method: str
    materialize_s: float
    attention_s: float
    load_s: float
    save_s: float
    segments: list[SegmentDecision]
    turn: str
    agent: str
    local_tokens: int  # rows vLLM's prefix cache held
    claimed_tokens: int
    claimed: bool  # False: the connector left the request to vLLM's own prefill (it reused nothing)
    load_steps: int
    load_step_batches: list[int]
    load_step_offsets_s: list[float]
    source_wait_s: float  # held back by the scheduler while a source cache was still being saved
    decide_wait_s: float  # waiting for the method's decision, made one engine step before the claim
    decided_ahead_s: float  # that decision's own time in the worker
    vllm_prefilled_tokens: int  # rows after the claim's stop, which vLLM prefilled itself
    rows_delivery_s: float  # reading rows the method observes, after the forward that computed them
    fallback: str  # "dense": the load failed and vLLM recomputed the request
    error: str


def vllm_prefill_stats(method: str, prompt_tokens: int, prefix_cached: int) -> LoadStats:
    """The stats of a request the connector did not claim (vLLM prefilled it): what a load that
    reused nothing would report, so that every request of a replay has its figures."""
    computed = max(0, prompt_tokens - 1 - prefix_cached)  # the last token is vLLM's in every request
    return {"method": method, "claimed": False, "reused_tokens": 0, "recomputed_tokens": computed,
            "eligible_tokens": 0, "ph_without_source_tokens": 0, "source_missing_tokens": 0,
            "local_tokens": prefix_cached, "claimed_tokens": 0}


def _checked(cls: type, raw: Any, what: str) -> dict[str, Any]:
    """The fields of dataclass `cls` from an RPC answer, refusing another contract version or a
    missing key with an error that names them."""
    if not isinstance(raw, dict):
        raise ContractError(f"{what}: expected an object, got {type(raw).__name__}")
    if raw.get("contract_version") != CONTRACT_VERSION:
        raise ContractError(f"{what}: the server speaks kvbench contract version {raw.get('contract_version')!r}, "
                            f"this replayer {CONTRACT_VERSION}; install the same kvbench on both sides")
    names = [f.name for f in fields(cls)]
    if missing := [name for name in names if name not in raw]:
        raise ContractError(f"{what}: the answer lacks {', '.join(missing)}")
    return {name: raw[name] for name in names}


@dataclass
class ServerInfo:
    """What a connector server runs (answer of WorkerRpc.INFO, one per worker)."""

    method: str
    params: dict[str, Any]
    model_attached: bool
    kvbench_version: str
    # the shared tier under its segment store (SharedTierSettings as a dict: its master...), or None
    shared_tier: dict[str, Any] | None = None
    contract_version: int = CONTRACT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> ServerInfo:
        return cls(**_checked(cls, raw, WorkerRpc.INFO))


@dataclass
class WorkerStats:
    """One worker's answer to WorkerRpc.STATS: per-request load stats since the last clearing,
    and its segment store's and method state's bytes."""

    method: str
    params: dict[str, Any]
    requests: dict[str, LoadStats]
    store_bytes: int
    store_peak_bytes: int
    store_entries: int
    store_evictions: int
    store_refused: int
    method_state_bytes: dict[str, int]
    model_attached: bool
    contract_version: int = CONTRACT_VERSION
    # room without a version bump: "deferred_s", seconds of the method's deferred work since the reset
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> WorkerStats:
        return cls(**_checked(cls, raw, WorkerRpc.STATS))


# ------------------------------------------------------------- a sweep's cells on a cluster (Ray)
CellTaskEventKind = Literal["started", "cell_started", "cell_finished", "log"]


@dataclass(frozen=True)
class CellTaskEvent:
    """What a sweep's Ray task (one method configuration's server and cells) yields its driver:
    `started` once its inputs are in place, `cell_started` before each run, `cell_finished` with
    the run folder's files, `log` with the server's log (also when the task fails). `files` are
    paths relative to the sweep folder; `sha256` their digests, checked before they are committed."""

    kind: CellTaskEventKind
    node: str  # the worker's host
    at: float  # the worker's clock (time.time()) when it was sent
    run: str | None = None  # the run folder, relative to the sweep folder
    files: dict[str, bytes] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)
    # started: kvbench_version, git_sha, entered_at (the task's start), inputs_s (placing the trace,
    # model and adapters);
    # cell_finished: run_s (the replay and its summary, on the worker)
    detail: dict[str, Any] = field(default_factory=dict)
    contract_version: int = CONTRACT_VERSION

    def checked(self) -> CellTaskEvent:
        """This event, if its worker speaks this kvbench's contract (ContractError otherwise)."""
        if self.contract_version != CONTRACT_VERSION:
            raise ContractError(f"node {self.node} runs kvbench contract version {self.contract_version}, this driver "
                                f"{CONTRACT_VERSION}; install the same kvbench on every node")
        return self
