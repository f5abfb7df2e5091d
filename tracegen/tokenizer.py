"""Tokenizer access for traces: exact per-segment token ids, and a fingerprint to detect mismatches."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvbench.model.resolve import resolve_model
from kvbench.model.store import EMBEDDED_PREFIX, embedded_name


@dataclass
class TraceTokenizer:
    """A fast (Rust) tokenizer used without special tokens, so segment ids concatenate exactly.
    Loaded with `tokenizers` alone (no transformers, no torch: a replay client needs neither)."""

    name: str  # portable name recorded in trace headers
    backend: Any  # tokenizers.Tokenizer
    prompt_prefix_ids: list[int]  # what the tokenizer puts before any text (e.g. BOS)
    # Where transformers loads the tokenizer from, when the model has a chat template (None: it
    # has none), and that tokenizer once loaded. `chat` loads it on first use: only benchmark
    # workloads and chat imports frame their prompts with it.
    chat_source: str | None = None
    chat_tokenizer: Any = None
    # The model's context length (its config's max_position_embeddings, else the tokenizer's
    # model_max_length), when the folder says; None: unknown (a hub name not cached, say)
    context_length: int | None = None
    _special_ids: frozenset[int] | None = field(default=None, repr=False)

    @property
    def chat(self) -> Any:
        """The transformers tokenizer (its apply_chat_template), or None without a chat template."""
        if self.chat_tokenizer is None and self.chat_source is not None:
            from transformers import AutoTokenizer

            self.chat_tokenizer = AutoTokenizer.from_pretrained(self.chat_source)
        return self.chat_tokenizer

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """A control token (end of sequence, end of turn) rather than text."""
        return token_id in self.special_ids

    @property
    def special_ids(self) -> frozenset[int]:
        if self._special_ids is None:
            self._special_ids = frozenset(i for i, token in self.backend.get_added_tokens_decoder().items()
                                          if token.special)
        return self._special_ids

    def message_ids(self, output_ids: Sequence[int]) -> list[int]:
        """What an agent's output passes on to later prompts: its message, up to the first control
        token (its end of sequence; under ignore_eos what follows that is not the message, and a
        special token in another agent's prompt would end or open a message there)."""
        for index, token_id in enumerate(output_ids):
            if token_id in self.special_ids:
                return list(output_ids[:index])
        return list(output_ids)

    @property
    def sha256(self) -> str:
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


def _local_files(path: str) -> tuple[Path, dict[str, Any]] | None:
    """tokenizer.json and tokenizer_config.json of a local model folder, or of a hub model in the
    local Hugging Face cache (None: neither; transformers then downloads it)."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(path, "tokenizer.json")
        except ValueError:  # not a hub name
            return None
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    return folder / "tokenizer.json", config


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _leading(with_specials: list[int], plain: list[int]) -> list[int]:
    """The ids a tokenizer puts before a text's own (`plain`) when it adds its special tokens."""
    return with_specials[: len(with_specials) - len(plain)] if with_specials[-len(plain):] == plain else []


def _prefix_ids(backend: Any, config: dict[str, Any]) -> list[int]:
    """What the tokenizer puts before text: its post-processor's, with `add_bos_token` of
    tokenizer_config.json applied as transformers applies it."""
    prefix = _leading(backend.encode("x").ids, backend.encode("x", add_special_tokens=False).ids)
    bos = _token_text(config.get("bos_token"))
    bos_id = backend.token_to_id(bos) if bos else None
    if config.get("add_bos_token") is True and bos_id is not None and prefix[:1] != [bos_id]:
        prefix = [bos_id, *prefix]
    elif config.get("add_bos_token") is False and bos_id is not None and prefix[:1] == [bos_id]:
        prefix = prefix[1:]
    return list(prefix)


@lru_cache(maxsize=8)
def load_tokenizer(model: str | None) -> TraceTokenizer:
    """Tokenizer of `--model`/`--tokenizer` (None: the embedded default model)."""
    path = resolve_model(model)
    name = model if model is not None and not model.startswith(EMBEDDED_PREFIX) else embedded_name(path)
    found = _local_files(path)
    if found is None:
        return _via_transformers(path, model, name)
    from tokenizers import Tokenizer

    tokenizer_json, config = found
    try:
        backend = Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:
        raise ValueError(f"cannot load a tokenizer for {model or path!r}: {exc}") from exc
    has_template = bool(config.get("chat_template")) or (tokenizer_json.parent / "chat_template.jinja").is_file()
    return TraceTokenizer(name=name, backend=backend, prompt_prefix_ids=_prefix_ids(backend, config),
                          chat_source=str(tokenizer_json.parent) if has_template else None,
                          context_length=_context_length(tokenizer_json.parent, config))


# transformers' "no limit" model_max_length (int(1e30)) and anything like it is no context length
_NO_LIMIT = 1 << 40


def _context_length(folder: Path, tokenizer_config: dict[str, Any]) -> int | None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    for value in (config.get("max_position_embeddings"), tokenizer_config.get("model_max_length")):
        if isinstance(value, int) and 0 < value < _NO_LIMIT:
            return value
    return None


def _via_transformers(path: str, model: str | None, name: str) -> TraceTokenizer:
    """A model without a tokenizer.json kvbench can read (a slow tokenizer, a hub name not yet
    cached): transformers loads it (and converts a slow one)."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer for {model or path!r}: {exc}") from exc
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"the tokenizer of {path!r} has no fast (Rust) backend; kvbench needs one "
                         "for exact per-segment token counts")
    prefix = _leading(hf("x").input_ids, backend.encode("x", add_special_tokens=False).ids)
    templated = bool(getattr(hf, "chat_template", None))
    limit = getattr(hf, "model_max_length", None)
    return TraceTokenizer(name=name, backend=backend, prompt_prefix_ids=list(prefix),
                          chat_source=path if templated else None, chat_tokenizer=hf if templated else None,
                          context_length=limit if isinstance(limit, int) and 0 < limit < _NO_LIMIT else None)
