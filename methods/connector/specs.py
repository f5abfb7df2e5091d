"""What the scheduler side asks the worker side to do for one request (vLLM-free)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.contracts import Plan


@dataclass
class LoadSpec:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_local: int  # rows already valid (vLLM prefix-cache hit)
    num_target: int  # rows valid after the load: prompt length - 1
    plan: Plan
    source_wait_s: float = 0.0  # how long the scheduler held it back while a source was being saved
    decide_wait_s: float | None = None  # from asking the worker's decision (DecideSpec) to the claim

    @property
    def key(self) -> str:
        """The name its stats are kept under: the cache it will be saved as, else its request."""
        return self.plan.save_as or self.req_id


@dataclass
class DecideSpec:
    """A request whose method decides what it reuses before the scheduler claims its rows
    (SharingMethod.decides_before_claim): the worker runs the decision and answers with the rows
    the connector will materialize (KVBenchWorkerMetadata.claims); vLLM prefills the rest."""

    req_id: str
    token_ids: list[int]  # the prompt but its last token: the rows a load could materialize
    num_local: int  # rows vLLM's prefix cache held when the decision was asked for
    plan: Plan

    @property
    def key(self) -> str:
        return self.plan.save_as or self.req_id

    @property
    def num_target(self) -> int:
        """Rows a claim could cover (as LoadSpec.num_target: the prompt but its last token)."""
        return len(self.token_ids)


@dataclass
class SaveSpec:
    req_id: str
    key: str
    token_ids: list[int]
    block_ids: list[int]
    # (prompt tokens, rows vLLM's prefix cache held) of a request the connector did not claim
    # (vLLM prefilled it): its stats are recorded at the save. None: a load reported it.
    unclaimed: tuple[int, int] | None = None
    keep: bool = True  # False: only its stats are recorded (no later turn reads its cache), nothing copied
    adapter: str | None = None  # the LoRA adapter it ran with (Plan.adapter): what wrote its values
    decide_wait_s: float | None = None  # an unclaimed request's wait for its decision (DecideSpec)
