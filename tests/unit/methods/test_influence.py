"""RelayCaching's attention influence: the attention mass each key row receives (pure torch)."""

from __future__ import annotations

import torch

from kvbench.methods.core.influence import attention_mass


def test_mass_is_causal_and_sums_to_queries_times_heads() -> None:
    torch.manual_seed(0)
    q, keys = torch.randn(3, 4, 8), torch.randn(10, 2, 8)  # 4 query heads over 2 KV heads
    positions = torch.tensor([4, 7, 9])
    mass = attention_mass(q, positions, keys, scale=8 ** -0.5)
    assert mass.shape == (10,)
    assert torch.allclose(mass.sum(), torch.tensor(3.0 * 4))  # each query head's softmax sums to 1
    only_last = attention_mass(q[2:], positions[2:], keys, scale=8 ** -0.5)
    assert torch.all(mass[8:] == only_last[8:])  # rows 8-9 are after positions 4 and 7: only the last query sees them


def test_mass_matches_explicit_softmax_with_grouped_heads() -> None:
    torch.manual_seed(1)
    q, keys = torch.randn(2, 4, 8), torch.randn(6, 2, 8)
    positions = torch.tensor([5, 3])
    expected = torch.zeros(6)
    for t in range(2):
        for h in range(4):
            k = keys[: positions[t] + 1, h // 2]  # query head h reads KV head h // 2
            expected[: positions[t] + 1] += torch.softmax(k @ q[t, h] * 0.5, dim=0)
    assert torch.allclose(attention_mass(q, positions, keys, scale=0.5), expected, atol=1e-6)
