"""Tokenizer access for traces: exact per-segment token ids, and a fingerprint to detect mismatches."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kvbench.model.resolve import resolve_model
from kvbench.model.store import EMBEDDED_PREFIX, embedded_name


@dataclass
class TraceTokenizer:
    """A fast (Rust) tokenizer used without special tokens, so segment ids concatenate exactly."""

    name: str  # portable name recorded in trace headers
    backend: Any  # tokenizers.Tokenizer
    prompt_prefix_ids: list[int]  # what the tokenizer puts before any text (e.g. BOS)
    # The transformers tokenizer when the model has a chat template (its apply_chat_template),
    # else None: benchmark workloads frame their prompts with it.
    chat: Any = None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """A control token (end of sequence, end of turn) rather than text."""
        return self.backend.decode([token_id], skip_special_tokens=True) == "" and \
            self.backend.decode([token_id], skip_special_tokens=False) != ""

    @property
    def sha256(self) -> str:
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


@lru_cache(maxsize=8)
def load_tokenizer(model: str | None) -> TraceTokenizer:
    """Tokenizer of `--model`/`--tokenizer` (None: the embedded default model)."""
    from transformers import AutoTokenizer

    path = resolve_model(model)
    try:
        hf = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer for {model or path!r}: {exc}") from exc
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"the tokenizer of {path!r} has no fast (Rust) backend; kvbench needs one "
                         "for exact per-segment token counts")
    with_specials = hf("x").input_ids
    plain = backend.encode("x", add_special_tokens=False).ids
    prefix = with_specials[: len(with_specials) - len(plain)] if with_specials[-len(plain):] == plain else []
    name = model if model is not None and not model.startswith(EMBEDDED_PREFIX) else embedded_name(path)
    chat = hf if getattr(hf, "chat_template", None) else None
    return TraceTokenizer(name=name, backend=backend, prompt_prefix_ids=list(prefix), chat=chat)
