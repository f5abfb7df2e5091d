"""CacheBlend's gradual filtering (its paper's section 4.3) through the connector's narrowing, with
no engine: each check layer picks among the rows the layer before kept, and the accounting counts
what each kept row computed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvbench.methods.api.base import MethodConfigError
from kvbench.methods.cacheblend import CacheBlend
from kvbench.methods.connector.materialize import Narrowing, count_rows, served_entries


def blend(**params: object) -> CacheBlend:
    method = CacheBlend({"check_layer": 1, **params})
    method.bind(SimpleNamespace(sum_over_ranks=lambda t: t, first_context_layer=1))  # type: ignore[arg-type]
    return method


def kv(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).reshape(-1, 1, 1)  # [rows, kv heads, head dim]


def test_each_filter_layer_picks_among_the_rows_the_one_before_kept() -> None:
    method = blend(filter_ratios=[0.5], recompute_ratio=0.25)
    assert method.check_layers() == [1, 2]
    rows = torch.arange(2, 10)  # rows 0-1 no source held; 2-9 reused
    reused = torch.zeros(10, dtype=torch.bool)
    reused[2:] = True
    zeros = kv([0.0] * 8)
    # Reused K/V kept at each check layer, in placement order. At layer 2 the dropped row 2 deviates
    # most: were it still a candidate, it would be picked.
    at_check = {1: (zeros, zeros), 2: (zeros, kv([100.0] + [0.0] * 7))}
    placement = SimpleNamespace(rows=rows, check_layers=[1, 2], at_check=at_check)
    ctx = SimpleNamespace(num_local=0, stats={})
    narrowing = Narrowing(SimpleNamespace(method=method), ctx, placement, reused, torch.zeros(1))  # type: ignore[arg-type]

    assert narrowing(0, torch.arange(10), kv([0.0] * 10), kv([0.0] * 10), kv([0.0] * 10)) is None
    # Layer 1: values deviate by row 2..9 as 1, 8, 2, 7, 3, 6, 4, 5: half of 8 kept, rows 3, 5, 7, 9.
    fresh = kv([0, 0, 1, 8, 2, 7, 3, 6, 4, 5])
    keep = narrowing(1, torch.arange(10), fresh, fresh, fresh)
    assert keep is not None and keep.tolist() == [0, 1, 3, 5, 7, 9]
    # Layer 2, computed rows 0, 1, 3, 5, 7, 9: a quarter of the 8 reused is 2, the most deviating
    # of the kept ones (rows 3 and 9), whatever the dropped rows' K/V.
    computed = torch.tensor([0, 1, 3, 5, 7, 9])
    fresh = kv([0, 0, 9, 1, 2, 8])
    keep = narrowing(2, computed, fresh, fresh, fresh)
    assert keep is not None and computed[keep].tolist() == [0, 1, 3, 9]
    assert narrowing.stages == [(1, 4), (2, 2)] and narrowing.picked == 2
    assert ctx.stats["blend"]["filtered"] == [{"layer": 1, "kept_tokens": 4}, {"layer": 2, "kept_tokens": 2}]
    assert ctx.stats["blend"]["candidate_tokens"] == 8 and ctx.stats["blend"]["picked_tokens"] == 2
    # Accounting over 4 layers: every row computes layers 0-1, 4 reused ones layer 2, 2 layer 3.
    assert count_rows(reused, torch.arange(10), narrowing.stages, 1, None, layers=4) == (6, 4)
    assert served_entries(8, narrowing.stages, 1, None, layers=4) == 8 * 4 - 8 * 2 - 4 - 2


def test_one_selection_without_filter_ratios_and_shares_never_below_the_final_one() -> None:
    assert blend().check_layers() == [1]
    method = blend(filter_ratios=[0.1, 0.4], recompute_ratio=0.25)  # 0.1 acts as 0.25
    assert method.check_layers() == [1, 2, 3]
    ctx = SimpleNamespace(stats={})
    values = kv([float(i) for i in range(8)])
    zeros = kv([0.0] * 8)
    picked = method.recompute(ctx, 1, values, values, zeros, zeros)  # type: ignore[arg-type]
    assert picked.tolist() == [False] * 6 + [True] * 2


def test_filtering_past_the_model_is_refused_at_attach() -> None:
    from kvbench.methods.connector.fits import check_method_fits

    with pytest.raises(MethodConfigError, match="last filtering layer"):
        check_method_fits(blend(filter_ratios=[0.5, 0.3]), 4, adapters_served=False)
    check_method_fits(blend(filter_ratios=[0.5]), 4, adapters_served=False)


def test_the_default_check_layer_leaves_a_layer_after_it() -> None:
    """A model whose context enters only in its last layer (kvbench:roles-deep, first context
    layer 7 of 8) checks at layer 6: at 7 there would be no later layer to act on."""
    from kvbench.methods.relaycaching import RelayCaching

    for method in (CacheBlend({}), RelayCaching({})):
        method.bind(SimpleNamespace(sum_over_ranks=lambda t: t, first_context_layer=7, num_layers=8))  # type: ignore[arg-type]
        assert method.check_layer() == 6
        method.bind(SimpleNamespace(sum_over_ranks=lambda t: t, first_context_layer=1, num_layers=8))  # type: ignore[arg-type]
        assert method.check_layer() == 1
