"""Which requests the connector loaded (or decided) vLLM has computed since: work a load queued
(anchor construction, matching ahead) waits for it, so that it stays out of the request's TTFT.

A synchronous load ends before the forward of the engine step that computes its request. An
asynchronous one ends in some step, and the scheduler computes the request in a later step; a
request whose rows after the claim vLLM prefills itself may take several steps (chunked
prefill). So the tracker does not count steps: the scheduler side marks the step whose forward
finishes a followed request's prompt (KVBenchMetadata.prefilled), and the request counts as
computed from the next step on.
"""

from __future__ import annotations

from collections.abc import Iterable


class ComputedRequests:
    def __init__(self) -> None:
        self._waiting: set[str] = set()  # loaded, not computed by any engine step since
        self._previous_step: frozenset[str] = frozenset()  # the requests whose prompt the previous step finished

    def step(self, prefilled: frozenset[str]) -> None:
        """At the start of an engine step whose forward finishes the prompts of `prefilled`: the
        previous step's have run their forward (and sampled) by now."""
        self._waiting -= self._previous_step
        self._previous_step = prefilled

    def loaded(self, req_id: str) -> None:
        """A load of `req_id` ended in the current step (or its decision was made: vLLM prefills it)."""
        self._waiting.add(req_id)

    def finished(self, req_ids: Iterable[str]) -> None:
        """Requests that finished or were aborted: nothing of theirs waits any more."""
        self._waiting.difference_update(req_ids)

    def computed(self, req_id: str) -> bool:
        """True once a step has computed `req_id` after its load ended (or it finished, or it was
        never loaded here)."""
        return req_id not in self._waiting
