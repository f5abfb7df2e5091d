"""The sampling parameters every request of a replay is sent with, recorded in config.json.

Greedy by default: quality is measured by comparing a method's outputs with a dense reference's,
which only means something when the outputs are deterministic. The names are vLLM's (its bench
CLI's `--temperature`, `--top-p`, `--top-k`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: every token

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (every token) or >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def request_fields(self) -> dict[str, Any]:
        """The fields of an OpenAI-compatible completions request (vLLM accepts top_k there)."""
        return asdict(self)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "greedy": self.greedy}

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        """From config.json; a run recorded before sampling was recorded was greedy."""
        if not raw:
            return cls()
        return cls(temperature=float(raw["temperature"]), top_p=float(raw["top_p"]), top_k=int(raw["top_k"]))
