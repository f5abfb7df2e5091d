"""KVComm: non-chained full-dimensional anchors from a context-free reference.
Its implementation: `kvbench.methods.kvcomm`."""

from __future__ import annotations

from pydantic import Field, field_validator

from kvbench.methods.api.params import MethodParams
from kvbench.methods.api.spec import MethodSpec
from kvbench.methods.delta.params import APPLY_CORRECTIONS_FIELD, GATE_FIELD, GateMode


class KVCommParams(MethodParams):
    V: int = Field(20, ge=1, description="anchors kept per shared slot")
    gamma: float = Field(0.3, ge=0, le=1, description="gate: dense when the match entropy > gamma * log2(anchors)")
    gate_tokens: int = Field(0, ge=0, description="tokens of a segment matched against anchors (0: all)")
    base_codec: str = Field("none", description="a KV codec keeping the full-size anchor bases compressed (e.g. "
                            "polykv, as `store_codec`): they only serve matching; corrections stay bf16")

    gate: GateMode = GATE_FIELD
    apply_corrections: bool = APPLY_CORRECTIONS_FIELD

    @field_validator("base_codec")
    @classmethod
    def _known_base_codec(cls, value: str) -> str:
        return MethodParams._known_codec(value)


SPEC = MethodSpec(
    name="kvcomm",
    summary="non-chained full-dimensional anchors from a context-free reference (V=20, gamma=0.3)",
    implementation="kvbench.methods.kvcomm:KVComm",
    Params=KVCommParams,
    threshold_name="gamma",
)
