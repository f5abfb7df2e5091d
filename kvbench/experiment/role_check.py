"""What reuse does on a role-family model, measured in transformers (no vLLM): dense and naively
reused answers, the answers' logit margins, and the structure of cross-role K/V deltas (where, in
which layers, of what rank, and whether they carry over between contents).

Naive reuse here is FullShared's: the target prompt's shared segment takes the source turn's
K/V (keys re-rotated to the target positions); everything else is computed. kvbench's connector
does the same inside vLLM; this is the offline check `kvbench model check` and the unit tests use.
Prompts are reference-anchored: every note holds the gold answer of its turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.tracegen.schema import Trajectory, Turn


@dataclass(frozen=True)
class ProbePrompt:
    ids: list[int]
    q_start: int  # the shared segment q's rows
    q_stop: int


def turn_prompt(builder: Any, trajectory: Trajectory, turn: Turn, outputs: dict[str, list[int]]) -> ProbePrompt:
    """Token ids of a turn's prompt (notes from `outputs`) and where its segment q lies."""
    ids = list(builder.prefix_ids)
    start = stop = -1
    for segment in turn.segments:
        piece = builder.segment_ids(trajectory, turn, segment, outputs)
        if segment.ph == "q":
            start, stop = len(ids), len(ids) + len(piece)
        ids += piece
    if start < 0:
        raise ValueError(f"turn {turn.turn_id} has no shared segment q")
    return ProbePrompt(ids, start, stop)


def _rotate(model: torch.nn.Module, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys [batch, heads, rows, head_dim] turned by RoPE at `positions` [rows] (may be negative)."""
    from transformers.models.llama.modeling_llama import rotate_half

    cos, sin = model.model.rotary_emb(keys, positions[None])  # [1, rows, head_dim]
    return keys * cos[:, None] + rotate_half(keys) * sin[:, None]


@torch.no_grad()
def dense_cache(model: torch.nn.Module, ids: list[int]) -> Any:
    return model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: list[int], steps: int, cache: Any = None) -> tuple[list[int], list[float]]:
    """Greedy continuation and, per step, the top logit's margin over the runner-up. With `cache`
    (holding a prefix of `ids`), only the rest is computed."""
    done = 0 if cache is None else cache.get_seq_length()
    inputs = torch.tensor([ids[done:]])
    tokens, margins = [], []
    for _ in range(steps):
        out = model(input_ids=inputs, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        inputs = top.indices[:1][None]
    return tokens, margins


@torch.no_grad()
def reused_cache(model: torch.nn.Module, target: ProbePrompt, source: ProbePrompt, source_cache: Any) -> Any:
    """The target prompt's cache up to the end of q, with q's rows taken from the source's cache."""
    from transformers import DynamicCache

    prefix = dense_cache(model, target.ids[:target.q_start]) if target.q_start else None
    shift = torch.full((target.q_stop - target.q_start,), target.q_start - source.q_start)
    cache = DynamicCache()
    for index, layer in enumerate(source_cache.layers):
        keys = _rotate(model, layer.keys[:, :, source.q_start:source.q_stop].float(), shift).to(layer.keys.dtype)
        values = layer.values[:, :, source.q_start:source.q_stop]
        if prefix is not None:
            keys = torch.cat([prefix.layers[index].keys, keys], dim=2)
            values = torch.cat([prefix.layers[index].values, values], dim=2)
        cache.update(keys, values, index)
    return cache


@torch.no_grad()
def shared_rows(model: torch.nn.Module, prompt: ProbePrompt) -> tuple[torch.Tensor, torch.Tensor]:
    """K (canonical: turned back to the segment's own positions 0, 1, ...) and V of q's rows, each
    [layers, rows, kv_heads * head_dim], fp32."""
    cache = dense_cache(model, prompt.ids[:prompt.q_stop])
    rows = prompt.q_stop - prompt.q_start
    back = torch.full((rows,), -prompt.q_start)
    keys, values = [], []
    for layer in cache.layers:
        k = _rotate(model, layer.keys[:, :, prompt.q_start:].float(), back)
        keys.append(k[0].transpose(0, 1).reshape(rows, -1))
        values.append(layer.values[0, :, prompt.q_start:].float().transpose(0, 1).reshape(rows, -1))
    return torch.stack(keys), torch.stack(values)


@dataclass(frozen=True)
class DeltaStructure:
    """How two readers' caches of one segment differ (K and V together, per layer)."""

    relative_norm_by_layer: list[float]  # ||delta|| / ||cache||
    effective_rank_by_layer: list[int]  # 90% energy; 0 where there is no delta
    token_share: float  # rows whose delta exceeds 1e-2 of the largest row delta


def delta_structure(source: tuple[torch.Tensor, torch.Tensor], target: tuple[torch.Tensor, torch.Tensor],
                    tolerance: float = 1e-3) -> DeltaStructure:
    from kvbench.model.realism import effective_rank

    delta = torch.cat([target[0] - source[0], target[1] - source[1]], dim=-1)  # [layers, rows, 2D]
    cache = torch.cat(target, dim=-1)
    norms, ranks = [], []
    for layer in range(delta.shape[0]):
        relative = float(delta[layer].norm() / cache[layer].norm().clamp_min(1e-30))
        norms.append(relative)
        ranks.append(effective_rank(delta[layer]) if relative > tolerance else 0)
    row_norms = delta.norm(dim=(0, 2))
    share = float((row_norms > 1e-2 * row_norms.max()).float().mean()) if float(row_norms.max()) > 0 else 0.0
    return DeltaStructure(norms, ranks, share)


def transfer_error(delta_a: torch.Tensor, delta_b: torch.Tensor) -> float:
    """||delta_a - delta_b|| / ||delta_a|| over the rows both cover: 0 when a correction learned on
    one content is exact on the other, about sqrt(2) when the two are unrelated."""
    n = min(delta_a.shape[1], delta_b.shape[1])
    a, b = delta_a[:, :n], delta_b[:, :n]
    return float((a - b).norm() / a.norm().clamp_min(1e-30))
