"""Attention influence of cached rows (RelayCaching): how much attention a set of query rows
pays each key row. Dense over the keys: it runs for a handful of queries (the prompt's tail)."""

from __future__ import annotations

import torch


def attention_mass(q: torch.Tensor, q_positions: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of q [m, Hq, hd] (rotated, at positions q_positions) over keys [n, Hkv, hd]
    (rotated, at positions 0..n-1), causal by position, summed over the m queries and the Hq
    heads: [n] in fp32. Grouped-query heads share their KV head as vLLM's kernels do."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,jhd->thj", q.float(), k) * scale
    future = torch.arange(len(keys), device=keys.device)[None, None, :] > q_positions.to(keys.device)[:, None, None]
    return scores.masked_fill_(future, float("-inf")).softmax(dim=-1).sum(dim=(0, 1))
