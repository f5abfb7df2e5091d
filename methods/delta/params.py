"""The parameters the delta methods share (their pydantic models; kvbench.methods.api.params).
Torch-free: their specs (kvbench.methods.specs) import them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvbench.methods.api.params import MethodParams

GateMode = Literal["entropy", "dense", "accept"]
AnchorSharing = Literal["tier", "instance"]

# Two switches every matching delta method takes after its own parameters. Off their defaults the
# method is a known one exactly (`kvbench check`): every segment dense is NonShared, every match
# accepted with no correction added is FullShared. (Fields, not a base class: a base's fields
# would come first in `kvbench methods` and the docs.)
GATE_FIELD = Field("entropy", description="entropy: the method's gate; dense: every shared segment prefilled "
                   "densely (and kept as an anchor); accept: every match of enough anchors taken, whatever its "
                   "entropy (kvbench check)")
APPLY_CORRECTIONS_FIELD = Field(True, description="add the interpolated corrections; false: an accepted segment "
                                "keeps the re-aligned source rows FullShared places (kvbench check)")


class DeltaParams(MethodParams):
    V: int = Field(10, ge=1, description="anchors kept per shared slot (online pool, LFU eviction)")
    tau: float = Field(0.3, ge=0, le=1, description="gate: dense when the match entropy > tau * log2(anchors)")
    r_c: int = Field(32, ge=1, description="rank of an anchor's base cache (truncated SVD)")
    r_delta: int = Field(32, ge=1, description="rank of an anchor's correction")
    gate_tokens: int = Field(0, ge=0, description="tokens of a segment matched against anchors (0: all)")
    # prematch: match a saved request's segments against the anchor pools right after its first
    # token (its rows are final), so that the edges reading them later only combine the kept
    # distances; off: every edge matches its source at load time, inside its TTFT.
    prematch: bool = Field(False, description="match a saved source's segments right after its first token, "
                           "outside the consumers' TTFT (chained only)")
    # With several instances on one shared tier (kvbench replay --instances N): `tier` shares every
    # anchor an instance observes with the others (kvbench.methods.delta.shared_anchors), so each
    # pool learns from every turn; `instance` keeps each pool to its own instance's turns.
    anchor_sharing: AnchorSharing = Field("tier", description="with --instances N on a shared tier: tier: every "
                                          "instance's anchors join every pool; instance: each pool learns from its "
                                          "own instance's turns only")
    gate: GateMode = GATE_FIELD
    apply_corrections: bool = APPLY_CORRECTIONS_FIELD


class NonChainedDeltaParams(DeltaParams):
    """A delta method's parameters when its sources are context-free references (not chained)."""

    @model_validator(mode="after")
    def _prematch_needs_chaining(self) -> NonChainedDeltaParams:
        if self.prematch:
            raise ValueError("prematch applies to chained sources only (a context-free reference's distances are "
                             "always kept for the agents after the first)")
        return self
