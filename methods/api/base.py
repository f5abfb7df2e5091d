"""The method interface: a sharing method decides *what* K/V to place; the connector
(`kvbench.methods.connector`) does the placing with the core (`kvbench.methods.core`). A method
is its spec (`kvbench.methods.specs.<name>`, light) and one subclass of `SharingMethod` here."""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from kvbench.contracts import Plan, PlanSegment
from kvbench.methods.api.params import MethodParams
from kvbench.methods.api.spec import MethodSpec
from kvbench.methods.core.errors import MethodConfigError
from kvbench.methods.core.lora import VLora
from kvbench.methods.core.store import SavedKV

__all__ = ["MethodConfigError", "MethodParams", "MethodSpec", "SharingMethod"]


def rows_digest(mask: torch.Tensor) -> str:
    """A short fingerprint of a row selection, to compare selections across tensor-parallel ranks."""
    return hashlib.sha1(mask.to(torch.bool).cpu().numpy().tobytes()).hexdigest()[:12]


@dataclass
class SegmentReuse:
    """Rows of one PH segment that a saved source cache holds with identical tokens."""

    segment: PlanSegment
    source: SavedKV
    dst: torch.Tensor  # row indices in the target request
    src: torch.Tensor  # row indices in the source cache


@dataclass
class LoadContext:
    request_key: str
    plan: Plan
    tokens: torch.Tensor  # [n] ids of the rows to materialize (prompt minus its last token)
    num_local: int  # rows 0..num_local-1 are already valid (vLLM prefix-cache hit)
    candidates: list[SegmentReuse]
    # Reads K, V [layers, len(rows), Hkv, hd] of this request's rows from the paged cache
    # (after the load: the materialized cache).
    read_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    stats: dict[str, Any] = field(default_factory=dict)  # the method adds its own entries
    req_id: str = ""  # vLLM's request id: work this load queues waits for core.computed(req_id)
    # The connector's: (rows, deliver) hands deliver(K, V) of rows once the request's prompt is
    # computed, also rows vLLM prefills after the claim (None: read_rows serves every row).
    when_prefilled: Callable[[torch.Tensor, Callable[[torch.Tensor, torch.Tensor], None]], None] | None = None

    def final_rows(self, rows: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor] | None]:
        """A getter of K, V [layers, len(rows), Hkv, hd] of this request's `rows` as computed,
        for work after its first token (`run_deferred`, once `core.computed(req_id)`): None when
        they never came (the request ended before its prompt was computed)."""
        if self.when_prefilled is None:
            return lambda: self.read_rows(rows)
        delivered: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.when_prefilled(rows, lambda k, v: delivered.append((k, v)))
        return lambda: delivered[0] if delivered else None


class CoreServices(Protocol):
    """What the connector core offers methods beyond placing rows."""

    aligner: Any  # kvbench.methods.core.rope.RopeAligner
    num_layers: int  # decoder layers of this worker's model
    # The first layer whose K/V can depend on more than a row's few neighbours (1 in a standard
    # model; kvbench.model.store.first_context_layer): where reuse error can first show.
    first_context_layer: int
    # Tensor-parallel ranks of the worker group; each holds its share of the KV heads, so a
    # quantity summed over heads is partial on one rank.
    tensor_parallel_size: int
    def sum_over_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        """`partial` summed over the tensor-parallel ranks (itself with one rank). Whatever decides
        which rows are reused or computed must come from such sums: the ranks run the partial
        forward's collectives together, so they must all decide alike."""

    def context_free_prefill_steps(self, tokens: torch.Tensor, adapter: str | None = None,
                                   value_inputs: Callable[[int, torch.Tensor], None] | None = None
                                   ) -> Generator[int, None, SavedKV]:
        """K/V of `tokens` prefilled alone at positions 0..n-1 (a context-free reference), one layer
        at a time: yields the rows each layer computed, returns the cache. `adapter`: the V-only
        LoRA adapter to run it with; `value_inputs` receives each layer's value-projection input."""

    def shared_state(self, namespace: str) -> Any:
        """A SharedState (kvbench.methods.core.shared_state) for method state under `namespace`,
        shared with the other instances on this worker's shared tier, with `anchor_shape` and
        `device` set for what it holds; None without a shared tier, or with several
        tensor-parallel ranks (their decisions must agree, and one rank could see a peer's anchor
        before another does)."""

    def adapter(self, name: str | None) -> VLora | None:
        """The served V-only adapter `name` (None for None); MethodConfigError for one the
        connector was not given (kv_connector_extra_config["adapters"])."""

    @property
    def adapters(self) -> dict[str, VLora]:
        """Every adapter the connector was given, by name."""

    def computed(self, req_id: str) -> bool:
        """Whether an engine step has computed the request's prompt (its first token) since its
        load ended (or its decision was made). A synchronous load's request is computed in the
        load's step; an asynchronous load's in a later one, not always the next; a request whose
        rows after the claim vLLM prefills, in the step that finishes them."""


class SharingMethod:
    """A sharing method's implementation: a subclass names its spec (`class X(SharingMethod,
    spec=SPEC)`), which sets the class attributes the spec declares, and overrides the hooks it
    needs. An intermediate base (DeltaCorrection, PReCache) names none."""

    spec: ClassVar[MethodSpec]
    # From the spec (kvbench.methods.api.spec.MethodSpec says what each means).
    name: ClassVar[str] = "base"
    summary: ClassVar[str] = ""
    approximate: ClassVar[bool] = True
    uses_connector: ClassVar[bool] = True
    Params: ClassVar[type[MethodParams]] = MethodParams
    threshold_name: ClassVar[str | None] = None
    threshold_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    rho_rises_with_threshold: ClassVar[bool] = True
    needs_adapters: ClassVar[bool] = False
    # Its `select` may leave candidates unused (a gate sending segments dense): the worker decides
    # one engine step before the claim, which then covers only the rows up to the last one reused;
    # vLLM prefills every row after it at its own speed (kvbench.methods.connector.scheduler).
    decides_before_claim: ClassVar[bool] = False

    def __init_subclass__(cls, spec: MethodSpec | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if spec is None:
            return
        cls.spec = spec
        cls.name, cls.summary, cls.Params = spec.name, spec.summary, spec.Params
        cls.approximate, cls.uses_connector, cls.needs_adapters = spec.approximate, spec.uses_connector, \
            spec.needs_adapters
        cls.threshold_name, cls.threshold_range = spec.threshold_name, spec.threshold_range
        cls.rho_rises_with_threshold = spec.rho_rises_with_threshold

    core: CoreServices | None = None

    def bind(self, core: CoreServices) -> None:
        """Called in the worker once the model is attached."""
        self.core = core

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = self.Params.parse(self.name, params)
        self.validate()

    def validate(self) -> None:
        """Raise MethodConfigError on parameter combinations `Params` cannot express alone."""

    def prepare(self, ctx: LoadContext) -> Generator[int, None, None]:
        """Work a load needs before `select`, one layer at a time: yields the rows each layer
        computed, so that asynchronous loads spread it over engine steps (e.g. a context-free
        reference's prefill). Default: none."""
        yield from ()

    def select(self, ctx: LoadContext) -> list[SegmentReuse]:
        """Which candidate rows to serve from reuse; the rest are computed. Default: all."""
        return ctx.candidates

    def correct(self, layer: int, reuse: SegmentReuse, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Adjust reused K (already re-aligned to target positions) and V of one layer. Both are
        fresh tensors owned by the caller: a method may change them in place and return them."""
        return keys, values

    def check_layer(self) -> int | None:
        """Selective recomputation (CacheBlend): layers 0..check_layer are computed for every row,
        reused rows included; after it, only the rows `recompute` keeps (and the rows no source
        held). With `recompute_layers` too (RelayCaching), reused rows are computed from the
        group's first layer to the check layer, and the kept ones until the group ends. None
        (default): reused rows are never computed."""
        return None

    def default_check_layer(self) -> int:
        """The model's first context-dependent layer (where reuse error can first show), or the
        last layer with one after it when context enters only in the model's last layer (a check
        needs a later layer to act on: kvbench:roles-deep reads roles in its last layer only)."""
        assert self.core is not None, "the default check layer needs the model (bind first)"
        return min(self.core.first_context_layer, self.core.num_layers - 2)

    def check_layers(self) -> list[int]:
        """Every layer where `recompute` narrows the computed reused rows, ascending: the check
        layer, then (gradual filtering) later ones, each choosing among the rows the one before
        kept. Default: the check layer alone."""
        check = self.check_layer()
        return [] if check is None else [check]

    def influence_queries(self) -> int:
        """How many of the prompt's last rows' attention at the check layer `recompute` receives
        (as the attention mass each reused row gets from them); 0 (default): none."""
        return 0

    def recompute(self, ctx: LoadContext, layer: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
                  reused_k: torch.Tensor, reused_v: torch.Tensor, influence: torch.Tensor | None = None) -> torch.Tensor:
        """At the check layer: a bool mask over the reused rows (those of `select`'s result, in its
        order) of those to keep computing, from their fresh and reused K, V [rows, Hkv, hd] and,
        when `influence_queries` asks for it, the attention mass [rows] they receive."""
        raise NotImplementedError(f"{self.name} sets check_layer() but not recompute()")

    def recompute_layers(self) -> tuple[int, int] | None:
        """Layer-selective recomputation (DroidSpeak): reused rows are computed in layers
        [start, stop), starting from the residual stream their source saved at `start` (from the
        token embeddings when start is 0), and keep the reused K/V in the other layers. None
        (default): reused rows are never computed. The connector then saves every request's
        stream at `start`."""
        return None

    def loads_request(self, plan: Plan) -> bool:
        """Whether the connector loads this request (claim policy "method", kvbench.contracts):
        by default when a shared segment names a source cache to reuse. Any other request is
        prefilled by vLLM in its own batches, and the connector only saves its cache. Asked on
        the scheduler side, before `bind`, so it reads only the plan and the parameters."""
        return self.loads_every_request() or bool(plan.sources)

    def loads_every_request(self) -> bool:
        """Whether every request is loaded, even one that reuses nothing: for a method whose sources
        must save what only the load captures. Default: no."""
        return False

    def after_load(self, ctx: LoadContext) -> None:
        """Called once the request's cache is materialized (e.g. to update method state)."""

    def after_save(self, key: str, entry: SavedKV, adapter: str | None) -> None:
        """Called when a finished request's cache is saved as `key` (written under LoRA `adapter`),
        before `run_deferred` of the same engine step: work on it goes there."""

    def run_deferred(self) -> None:
        """Work queued by after_load, run at the start of a later engine step, after the request's
        first token (outside its TTFT, inside E2E): a method keeps each item until
        `core.computed(ctx.req_id)`."""

    def shared_report(self) -> dict[str, Any]:
        """What its state shared between instances did: {"shared_state": counts}, or {} (WorkerStats.extra)."""
        return {}

    def state_bytes(self) -> dict[str, int]:
        """Exact tensor bytes of the method's own state (anchor pools, references...)."""
        return {}

    def reset(self) -> None:
        """Drop learned state between runs."""

    def restart_peaks(self) -> None:
        """A run starts with the learned state kept (primed): peak figures restart from now."""


def load_implementation(dotted: str) -> type[SharingMethod]:
    """The class at "package.module:Class" (a spec's `implementation`); MethodConfigError when it
    cannot be imported or is no SharingMethod."""
    module_name, _, class_name = dotted.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise MethodConfigError(f"cannot load the method implementation {dotted!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, SharingMethod)):
        raise MethodConfigError(f"{dotted} is not a SharingMethod subclass")
    return cls
