"""Anchor pools shared between instances through a real Mooncake master (issue 68): an anchor one
instance observed joins another's pool, a known anchor gains the corrections another instance
saw, an evicted one leaves; a foreign or corrupt value is counted and never joins a pool."""

from __future__ import annotations

import json

import pytest
import torch

from kvbench.methods.core.mooncake_tier import MooncakeTier
from kvbench.methods.core.shared_state import SharedState
from kvbench.methods.delta.anchor_bytes import AnchorError, AnchorShape, anchor_from_bytes, anchor_to_bytes
from kvbench.methods.delta.anchors import AnchorPool
from kvbench.methods.delta.shared_anchors import AnchorExchange

LAYERS, FEATURES = 3, 16
SHAPE = AnchorShape(LAYERS, FEATURES)


@pytest.fixture(scope="module")
def clients():
    from kvbench.server.mooncake_master import MooncakeMaster

    pytest.importorskip("mooncake.store", reason="the [mooncake] extra (scripts/install.sh installs it)")
    with MooncakeMaster() as running:
        settings = running.address.tier_settings(64 << 20)
        made = [MooncakeTier(settings), MooncakeTier(settings)]
        yield made
        for client in made:
            client.close()


def _tensor(seed: int, n: int = 12) -> torch.Tensor:
    return torch.randn(LAYERS, n, FEATURES, generator=torch.Generator().manual_seed(seed))


def _observe(pool: AnchorPool, anchor_id: str, edge: str, seed: int, rank: int | None = 4) -> None:
    pool.add(anchor_id, edge, _tensor(seed), _tensor(seed + 1), _tensor(seed + 2), _tensor(seed + 3), rank, rank,
             torch.bfloat16)


def _exchanges(clients, namespace: str) -> tuple[AnchorExchange, AnchorExchange]:
    return tuple(AnchorExchange(SharedState(client, "m", namespace), "m") for client in clients)  # type: ignore[return-value]


def test_an_anchor_observed_on_one_instance_joins_the_others_pool(clients) -> None:
    a, b = _exchanges(clients, "join")
    pool_a, pool_b = AnchorPool(4), AnchorPool(4)
    _observe(pool_a, "t0/q", "A0->A1", seed=1)
    a.publish("q", pool_a, "t0/q")
    assert b.pull("q", pool_b, SHAPE, "cpu") == 1 and list(pool_b.anchors) == ["t0/q"]
    sent, got = pool_a.anchors["t0/q"], pool_b.anchors["t0/q"]
    assert torch.equal(got.base_v.rows(12), sent.base_v.rows(12))
    assert torch.equal(got.deltas["A0->A1"][1].rows(12), sent.deltas["A0->A1"][1].rows(12))
    assert b.pull("q", pool_b, SHAPE, "cpu") == 0  # taken at this version: not read again
    # the other instance saw another edge of the same anchor: the reader's copy gains it, keeps its own
    _observe(pool_b, "t0/q", "A0->A2", seed=1)
    b.publish("q", pool_b, "t0/q")
    assert a.pull("q", pool_a, SHAPE, "cpu") == 1
    assert sorted(pool_a.anchors["t0/q"].deltas) == ["A0->A1", "A0->A2"]
    counts = b.state.counts
    assert counts.imported == 1 and counts.rejected == 0 and counts.remote_bytes > 0
    assert a.state.counts.puts >= 2 and a.state.counts.put_bytes > sent.nbytes // 2


def test_an_evicted_anchor_leaves_the_index_and_a_reset_empties_it(clients) -> None:
    a, b = _exchanges(clients, "evict")
    pool_a = AnchorPool(1)
    _observe(pool_a, "t0/q", "A0->A1", seed=1)
    a.publish("q", pool_a, "t0/q")
    _observe(pool_a, "t1/q", "A0->A1", seed=5)  # the pool of one evicts t0/q
    a.publish("q", pool_a, "t1/q")
    pool_b = AnchorPool(4)
    assert b.pull("q", pool_b, SHAPE, "cpu") == 1 and list(pool_b.anchors) == ["t1/q"]
    a.forget()
    assert b.pull("q", AnchorPool(4), SHAPE, "cpu") == 0


def test_foreign_or_corrupt_anchors_are_counted_and_never_join(clients) -> None:
    a, b = _exchanges(clients, "forged")
    pool_a = AnchorPool(8)
    _observe(pool_a, "good", "A0->A1", seed=1)
    a.publish("q", pool_a, "good")
    writer = a.state.writer
    forged = {
        "wide": anchor_to_bytes(_wide_anchor(), "q", "m"),  # another model's heads
        "model": anchor_to_bytes(pool_a.anchors["good"], "q", "other-model"),
        "slot": anchor_to_bytes(pool_a.anchors["good"], "r", "m"),
        "junk": b"\x00" * 40,
        "nan": anchor_to_bytes(_nan_anchor(), "q", "m"),
    }
    for name, value in forged.items():
        clients[0].store.upsert(f"{a.state.prefix}/w{writer}/q/anchor/{name}", value)
    index = {"good": 1, **dict.fromkeys(forged, 1)}
    clients[0].store.upsert(f"{a.state.prefix}/w{writer}/q/index", json.dumps(index).encode())
    pool_b = AnchorPool(8)
    assert b.pull("q", pool_b, SHAPE, "cpu") == 1 and list(pool_b.anchors) == ["good"]
    assert b.state.counts.rejected == len(forged)
    clients[0].store.upsert(f"{a.state.prefix}/w{writer}/q/index", b"[1, 2]")  # an index that is no object
    assert b.pull("q", pool_b, SHAPE, "cpu") == 0 and b.state.counts.rejected == len(forged) + 1


def _wide_anchor():
    pool = AnchorPool(1)
    wide = lambda s: torch.randn(LAYERS, 12, 2 * FEATURES, generator=torch.Generator().manual_seed(s))  # noqa: E731
    pool.add("wide", "A0->A1", wide(1), wide(2), wide(3), wide(4), None, None, torch.bfloat16)
    return pool.anchors["wide"]


def _nan_anchor():
    pool = AnchorPool(1)
    bad = _tensor(9)
    bad[0, 0, 0] = float("nan")
    pool.add("nan", "A0->A1", _tensor(1), _tensor(2), _tensor(3), bad, None, None, torch.bfloat16)
    return pool.anchors["nan"]


def test_anchor_bytes_round_trip_full_and_low_rank_and_refuse_other_shapes() -> None:
    for rank in (None, 4):
        pool = AnchorPool(1)
        _observe(pool, "x", "A0->A1", seed=3, rank=rank)
        anchor = pool.anchors["x"]
        back = anchor_from_bytes(anchor_to_bytes(anchor, "q", "m"), "m", "q", SHAPE)
        assert torch.equal(back.base_k.rows(12), anchor.base_k.rows(12)) and back.source == "A0"
        with pytest.raises(AnchorError, match="this model's anchors|do not make"):
            anchor_from_bytes(anchor_to_bytes(anchor, "q", "m"), "m", "q", AnchorShape(LAYERS + 1, FEATURES))


@pytest.mark.parametrize("sharing", ["tier", "instance"])
def test_kvcmas_on_one_instance_reuses_with_anchors_another_observed(clients, sharing: str) -> None:
    """Instance A's KVCMAS observes three contents densely (its pool fills); instance B, which saw
    none of them, then meets one: with shared pools it takes A's anchors and accepts the match;
    with per-instance pools (`anchor_sharing=instance`) its empty pool sends the turn dense."""
    from test_anchors import LAYERS as CACHE_LAYERS
    from test_anchors import _context, _FakeCore

    from kvbench.methods.core.entry_bytes import EntryShape
    from kvbench.methods.registry import method_class

    shape = EntryShape(CACHE_LAYERS, 4, 32, torch.float32)
    states = [SharedState(client, "m", f"kvcmas-{sharing}", shape=shape) for client in clients]
    a, b = (method_class("kvcmas")({"r_c": 64, "r_delta": 64, "anchor_sharing": sharing}) for _ in states)
    a.bind(_FakeCore(states[0]))
    b.bind(_FakeCore(states[1]))
    for index in range(3):
        ctx, _, _ = _context("kvcmas", f"t{index}", seed=index)
        assert a.select(ctx) == []  # dense: observed as an anchor
        a.after_load(ctx)
        a.run_deferred()
    ctx, _, _ = _context("kvcmas", "t9", seed=1)  # content A saw, on B
    chosen = b.select(ctx)
    decision = ctx.stats["decisions"][0]
    if sharing == "tier":
        assert len(chosen) == 1 and decision["decision"] == "accepted" and len(b.pools["q"].anchors) == 3
        assert b.shared_report()["shared_state"]["imported"] == 3 and a.shared_report()["shared_state"]["puts"] >= 3
    else:
        assert chosen == [] and decision["decision"] == "dense_few_anchors"
        assert a.shared_report()["shared_state"]["puts"] == 0 and b.shared_report()["shared_state"]["imported"] == 0
    a.reset()  # a reset withdraws what A published
    assert b.exchange is not None and b.exchange.pull("q", AnchorPool(10), AnchorShape(CACHE_LAYERS, 128), "cpu") == 0
