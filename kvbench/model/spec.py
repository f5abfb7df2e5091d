"""Architecture and training recipe of the embedded model (one place, hashed into its name)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

# Bump when the build procedure changes in a way the spec fields do not capture.
BUILD_RECIPE_VERSION = 1


def spec_digest(spec: Any, recipe_version: int) -> str:
    """Short stable hash of a model spec (a dataclass) and its recipe version: the cache name's."""
    payload = json.dumps({"recipe": recipe_version, **dataclasses.asdict(spec)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the embedded model besides the seed and the corpus."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32
    # Long enough for 32K shared tokens plus 8 agents x 8 rounds of outputs and role prompts.
    max_position_embeddings: int = 65536
    rope_theta: float = 500000.0
    # Training: enough AdamW steps that attention is far from uniform (docs/models.md).
    train_steps: int = 240
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    # Fixed so reductions run in the same order on every machine of the same ISA.
    torch_threads: int = 2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return spec_digest(self, BUILD_RECIPE_VERSION)

    def with_overrides(self, **overrides: Any) -> TinyModelSpec:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown model spec field(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **overrides)
