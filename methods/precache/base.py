"""PReCache's shared core: agents as V-only LoRA adapters over one base cache.

An adapter changes only the value projection, V = W_v X + (alpha / r) (X A^T) B^T, so one cache of
keys and base values plus, per adapter, the rank-r "LR cache" X A^T of every token rebuilds any
agent's values: V_j = V_base + (alpha_j / r_j) LR_j B_j^T. The two variants differ in the pass
that computes X (and the base cache):

- PreLR (`precache-prelr`): the writer's own adapted pass. The reused cache is the writer's as
  saved; its values lose the writer's term and gain the reader's.
- ReBase (`precache-rebase`): an adapter-free pass. Keys and base values come from it, and the
  reader's term is added to them.

Where PReCache's engine computes the LR entries inside the writer's pass (PreLR) or in a lazy or
batched adapter-free pass beside it (ReBase), kvbench's connector runs outside vLLM's batched
forward: it computes them in one pass of its own over the source's tokens (context-free: the
source's prompt starts at position 0), as deferred work when the source is saved (`after_save`,
before the next engine step's loads), or at the reader's load when the reader comes first (then
inside its TTFT; `precache_build_s` says so). The double-batch schedule (the adapter-free rows in
the writer's own batch) needs rows added to vLLM's forward, which a KV connector cannot do.

Both variants hold X's projections for every served adapter (LR cache: r values per token, layer
and adapter) and ReBase also the base K/V, in an LRU capped by `max_state_gib`; an entry dropped
there is rebuilt at the next load that needs it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbench.methods.api.base import LoadContext, MethodConfigError, SegmentReuse, SharingMethod
from kvbench.methods.core.forward import run_to_end
from kvbench.methods.core.store import SavedKV

logger = logging.getLogger(__name__)


@dataclass
class LowRankEntry:
    """One saved source's LR cache: X A_j^T [L, n, r_j] per adapter j, and (ReBase) its base K/V."""

    low_rank: dict[str, torch.Tensor]
    base: SavedKV | None
    build_s: float

    @property
    def lr_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.low_rank.values())

    @property
    def base_bytes(self) -> int:
        return 0 if self.base is None else self.base.nbytes

    @property
    def tokens(self) -> int:
        return int(next(iter(self.low_rank.values())).shape[1]) if self.low_rank else 0


@dataclass
class LowRankReuse(SegmentReuse):
    """A reused segment with what rebuilding its values needs."""

    entry: LowRankEntry | None = None
    reader: str | None = None  # the loading request's adapter
    writer: str | None = None  # the adapter whose term the source's values hold (None: none to remove)


class PReCache(SharingMethod):
    """Base of both variants: a subclass sets `adapter_free_base`."""

    adapter_free_base: ClassVar[bool] = False

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__(params)
        self.entries: OrderedDict[str, LowRankEntry] = OrderedDict()
        self.pending: list[tuple[str, SavedKV, str | None]] = []  # saved sources waiting for their build
        self.peak: dict[str, int] = {}

    # ---------------------------------------------------------------- building the LR cache
    def _build(self, source: SavedKV, writer: str | None) -> Generator[int, None, LowRankEntry]:
        assert self.core is not None, "bind first"
        adapters = self.core.adapters
        if not adapters:
            raise MethodConfigError(f"{self.name}: the server serves no LoRA adapters (a trace with adapters, "
                                    "gen-trace --adapter, starts it with them)")
        n, layers = len(source.token_ids), self.core.num_layers
        low_rank = {name: torch.empty(layers, n, lora.rank, dtype=lora.a.dtype, device=lora.a.device)
                    for name, lora in adapters.items()}

        def keep(layer: int, x: torch.Tensor) -> None:
            for name, lora in adapters.items():
                low_rank[name][layer] = lora.low_rank(layer, x)

        started = time.perf_counter()
        run_with = None if self.adapter_free_base else writer
        passed = yield from self.core.context_free_prefill_steps(source.token_ids, run_with, keep)
        base = SavedKV(source.token_ids, passed.k, passed.v, exact_rows=0) if self.adapter_free_base else None
        return LowRankEntry(low_rank, base, time.perf_counter() - started)

    def _keep(self, key: str, entry: LowRankEntry) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        budget = int(self.params["max_state_gib"] * (1 << 30))
        while len(self.entries) > 1 and sum(e.lr_bytes + e.base_bytes for e in self.entries.values()) > budget:
            self.entries.popitem(last=False)
        current = self._current_bytes()
        self.peak = {k: max(v, self.peak.get(k, 0)) for k, v in current.items()}

    def after_save(self, key: str, entry: SavedKV, adapter: str | None) -> None:
        if self.params["eager_build"] and self.core is not None and self.core.adapters:
            self.pending.append((key, entry, adapter))

    def run_deferred(self) -> None:
        pending, self.pending = self.pending, []
        for key, source, writer in pending:
            try:
                self._keep(key, run_to_end(self._build(source, writer)))
            except Exception:  # its readers build it at their load instead
                logger.exception("kvbench: %s could not build the LR cache of %s", self.name, key)

    # ---------------------------------------------------------------- loads
    def prepare(self, ctx: LoadContext) -> Generator[int, None, None]:
        assert self.core is not None, "bind first"
        self.core.adapter(ctx.plan.adapter)  # a reader the connector cannot serve fails here, clearly
        built, seconds = 0, 0.0
        for reuse in ctx.candidates:
            key = reuse.segment.source
            if key is None or key in self.entries:
                if key is not None:
                    self.entries.move_to_end(key)
                continue
            entry = yield from self._build(reuse.source, reuse.segment.source_adapter)
            self._keep(key, entry)
            built, seconds = built + entry.tokens, seconds + entry.build_s
        if built:
            ctx.stats.update(precache_built_tokens=built, precache_build_s=seconds)

    def select(self, ctx: LoadContext) -> list[SegmentReuse]:
        chosen: list[SegmentReuse] = []
        for reuse in ctx.candidates:
            entry = self.entries.get(reuse.segment.source or "")
            if entry is None:  # dropped between prepare and select: computed instead
                continue
            source = entry.base if entry.base is not None else reuse.source
            writer = None if self.adapter_free_base else reuse.segment.source_adapter
            chosen.append(LowRankReuse(reuse.segment, source, reuse.dst, reuse.src, entry=entry,
                                       reader=ctx.plan.adapter, writer=writer))
            # the LR cache's size, counted from its tensors: 2 r L bytes (bf16) per token and adapter
            ctx.stats["lr_cache_bytes_per_token_adapter"] = entry.lr_bytes / max(1, entry.tokens * len(entry.low_rank))
        return chosen

    def correct(self, layer: int, reuse: SegmentReuse, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(reuse, LowRankReuse) and reuse.entry is not None and self.core is not None
        if reuse.reader == reuse.writer:  # PreLR read by its own writer's adapter: the values as saved
            return keys, values
        flat = values.reshape(len(values), -1)
        src = reuse.src.to(flat.device)
        for name, sign in ((reuse.reader, 1.0), (reuse.writer, -1.0)):
            lora = self.core.adapter(name)
            if lora is not None:
                term = lora.value_term(layer, reuse.entry.low_rank[lora.name][layer, src])
                flat.add_(term.to(flat.dtype), alpha=sign)
        return keys, flat.reshape(values.shape)  # `flat` may be a copy when `values` is not contiguous

    # ---------------------------------------------------------------- state
    def _current_bytes(self) -> dict[str, int]:
        return {"lr_cache": sum(e.lr_bytes for e in self.entries.values()),
                "base_cache": sum(e.base_bytes for e in self.entries.values())}

    def state_bytes(self) -> dict[str, int]:
        return {**self._current_bytes(), **{f"peak_{k}": v for k, v in self.peak.items()}}

    def restart_peaks(self) -> None:
        self.peak = self._current_bytes()

    def reset(self) -> None:
        self.entries.clear()
        self.pending.clear()
        self.peak = {}
