"""Does a model read its context the way real LLMs do? Figures computed with transformers alone
(no vLLM): held-out loss by position, attention sinks, and the structure of cross-agent deltas.
`kvbench model check` adds the serving figures (kvbench.experiment.model_check).

Each figure names what real models show: loss that does not rise with position (they use long
context), attention mass on the first token in later layers (sinks), and cross-agent value deltas
of low effective rank (what delta correction interpolates).
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvbench.model.corpus import read_corpus_files

# Position buckets of the held-out loss: the first is the model's short-context baseline.
POSITION_BUCKETS = ((0, 256), (256, 2048), (2048, 8192), (8192, 32768))
SINK_QUERIES = 32  # attention of the last rows of a window, where the context is longest
HELDOUT_PACKAGES = ("click", "rich", "aiohttp")  # installed with kvbench; not in the old model's corpus


def heldout_documents(manifest: dict[str, Any] | None = None) -> list[str]:
    """Text the model did not train on: the files its manifest lists as held out, else the Python
    sources of a few packages kvbench installs (sorted, so every machine reads the same text)."""
    root = Path(sysconfig.get_paths()["purelib"])
    if manifest and manifest.get("heldout_files"):
        names = list(manifest["heldout_files"])
    else:
        names = [str(p.relative_to(root)) for package in HELDOUT_PACKAGES for p in sorted((root / package).rglob("*.py"))]
    documents = read_corpus_files(names)
    if not documents:
        raise FileNotFoundError(f"no held-out text found under {root}")
    return documents


def heldout_windows(tokenizer: Any, documents: Sequence[str], length: int, count: int) -> list[list[int]]:
    """`count` windows of `length` tokens cut from the documents joined in order."""
    ids: list[int] = []
    for ids_of_doc in tokenizer.encode_batch(list(documents)):
        ids += ids_of_doc
        if len(ids) >= length * count:
            break
    if len(ids) < length:
        raise ValueError(f"held-out text has {len(ids)} tokens, fewer than one {length}-token window")
    return [ids[i * length:(i + 1) * length] for i in range(min(count, len(ids) // length))]


def token_losses(model: torch.nn.Module, ids: list[int], chunk: int = 2048) -> torch.Tensor:
    """Next-token cross-entropy at every position of one window (the LM head in chunks, so a
    128K-vocabulary model's logits never exist for the whole window at once)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    with torch.no_grad():
        hidden = model.model(input_ids=tokens).last_hidden_state[0]
        losses = []
        for start in range(0, len(ids) - 1, chunk):
            stop = min(start + chunk, len(ids) - 1)
            logits = model.lm_head(hidden[start:stop]).float()
            losses.append(torch.nn.functional.cross_entropy(logits, tokens[0, start + 1:stop + 1], reduction="none"))
    return torch.cat(losses).cpu()


def loss_by_position(losses: Sequence[torch.Tensor]) -> dict[str, float]:
    """Mean loss per position bucket over the windows (buckets the windows do not reach are left
    out); position p is the loss of predicting token p + 1 from tokens 0..p."""
    out = {}
    for low, high in POSITION_BUCKETS:
        values = [w[low:high] for w in losses if len(w) > low]
        if values:
            out[f"{low}-{high}"] = float(torch.cat(values).mean())
    return out


@contextmanager
def attention_sink_probe(model: torch.nn.Module) -> Iterator[dict[int, float]]:
    """While active, every forward records per layer the mean attention mass that the last
    SINK_QUERIES query rows give the first token (over heads), beside the model's own attention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sinks: dict[int, float] = {}

    def probe(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        rows = min(SINK_QUERIES, query.shape[2])
        groups = query.shape[1] // key.shape[1]
        keys = key.repeat_interleave(groups, dim=1).float()
        scores = query[:, :, -rows:].float() @ keys.transpose(-1, -2) * (kwargs.get("scaling") or query.shape[-1] ** -0.5)
        # the last `rows` queries sit at the last positions: each sees the keys up to its own
        positions = torch.arange(key.shape[2] - rows, key.shape[2], device=key.device)
        scores = scores.masked_fill(torch.arange(key.shape[2], device=key.device)[None, :] > positions[:, None],
                                    float("-inf"))
        sinks[int(module.layer_idx)] = float(scores.softmax(-1)[..., 0].mean())
        return out

    AttentionInterface.register("kvbench_sink_probe", probe)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvbench_sink_probe")
    try:
        yield sinks
    finally:
        model.set_attn_implementation(previous)


def effective_rank(matrix: torch.Tensor, energy: float = 0.9) -> int:
    """The fewest singular directions holding `energy` of the matrix's squared Frobenius norm."""
    values = torch.linalg.svdvals(matrix.float())
    shares = (values ** 2).cumsum(0) / max(float((values ** 2).sum()), 1e-30)
    return int((shares < energy).sum()) + 1


def repeated_ngram_share(tokens: Sequence[int], n: int = 4) -> float:
    """Share of an output's n-grams that already occurred earlier in it (0: none repeat;
    near 1: a loop). NaN for outputs shorter than n."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return math.nan
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams)


def shared_rows_values(model: torch.nn.Module, prompt: list[int], start: int, stop: int) -> torch.Tensor:
    """V [layers, rows, kv_heads * head_dim] of prompt rows start..stop (the prompt is run up to
    `stop`: later rows cannot change them)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([prompt[:stop]], device=device), use_cache=True).past_key_values
    return torch.stack([layer.values[0, :, start:stop].transpose(0, 1).reshape(stop - start, -1)
                        for layer in cache.layers]).float().cpu()
