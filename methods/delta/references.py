"""Context-free references: what a non-chained delta method (GraphFlow, KVComm, kvcmas-nonchained)
corrects from. Each shared segment is prefilled alone (kvcomm-ref: after the prompt's own prefix,
its BOS), kept by content (a trajectory id repeats across runs on a long-lived server), least
recently used dropped first, and prefilled one layer at a time so that asynchronous loads spread
an 8K prefill over engine steps."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Generator, Hashable

import torch

from kvbench.contracts import PlanSegment
from kvbench.methods.api.base import CoreServices, LoadContext, SegmentReuse
from kvbench.methods.core.forward import run_to_end
from kvbench.methods.core.store import SavedKV

MAX_REFERENCES = 256
Key = tuple[str, str]  # (segment id, content)


def content_key(tokens: torch.Tensor) -> str:
    """Identity of a segment's content: trajectory ids repeat across runs and traces on a
    long-lived server, so a context-free reference is keyed by its tokens alone."""
    return hashlib.sha1(tokens.to(torch.int64).numpy().tobytes()).hexdigest()[:20]


class ContextFreeReferences:
    def __init__(self, with_prefix: bool) -> None:
        self.with_prefix = with_prefix  # kvcomm-ref: prefill after the prompt's own prefix
        self.entries: OrderedDict[Key, SavedKV] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.entries.values())

    def tokens(self, ctx: LoadContext, start: int, stop: int) -> torch.Tensor:
        """What a reference of rows [start, stop) prefills: the rows alone, or after the prompt's
        own prefix (the tokens before its first segment)."""
        rows = ctx.tokens[start:stop]
        if not self.with_prefix or not ctx.plan.segments:
            return rows
        return torch.cat((ctx.tokens[:ctx.plan.segments[0].start], rows))

    def span(self, ctx: LoadContext, segment: PlanSegment, reads_producer: bool) -> tuple[int, int, Key] | None:
        """Rows [start, stop) of a PH segment a reference stands for, and the reference's key; None
        where the segment is left to dense computation (partly in vLLM's prefix cache, or cut by the
        prompt end) or read from its producer (`reads_producer`)."""
        start, stop = max(segment.start, ctx.num_local), min(segment.start + segment.length, len(ctx.tokens))
        if segment.kind != "ph" or stop <= start or start != segment.start or reads_producer:
            return None
        return start, stop, (segment.id, content_key(self.tokens(ctx, start, stop)))

    def prefill(self, core: CoreServices, ctx: LoadContext, start: int, stop: int,
                key: Key) -> Generator[int, None, SavedKV]:
        """Prefill and keep the reference of rows [start, stop), one layer at a time (yields the
        rows each layer computed); its time and tokens go into the load's stats."""
        steps, seconds = core.context_free_prefill_steps(self.tokens(ctx, start, stop)), 0.0
        while True:  # timed layer by layer: the waits between engine steps are not prefill
            started = time.perf_counter()
            try:
                rows = next(steps)
            except StopIteration as done:
                reference = done.value
                seconds += time.perf_counter() - started
                ctx.stats["reference_prefill_s"] = ctx.stats.get("reference_prefill_s", 0.0) + seconds
                ctx.stats["reference_tokens"] = ctx.stats.get("reference_tokens", 0) + len(reference.token_ids)
                self.entries[key] = reference
                while len(self.entries) > MAX_REFERENCES:
                    self.entries.popitem(last=False)
                return reference
            seconds += time.perf_counter() - started
            yield rows

    def reuse(self, core: CoreServices, ctx: LoadContext, segment: PlanSegment,
              reads_producer: bool) -> tuple[SegmentReuse | None, Hashable]:
        """The segment's rows from its reference (prefilled by the method's `prepare`, or here on
        first sight), and the key of its memoized distances; (None, None) without a reference."""
        span = self.span(ctx, segment, reads_producer)
        if span is None:
            return None, None
        start, stop, key = span
        reference = self.entries.get(key)
        if reference is None:  # a caller that did not run `prepare`
            reference = run_to_end(self.prefill(core, ctx, start, stop, key))
        else:
            self.entries.move_to_end(key)
        dst = torch.arange(start, stop)
        prefix = len(reference.token_ids) - (stop - start)  # rows before the segment's in the reference
        return SegmentReuse(segment, reference, dst, dst - segment.start + prefix), ("ref", *key)
