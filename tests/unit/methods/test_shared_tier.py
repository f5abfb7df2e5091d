"""The shared tier under the segment store (issue 53): entries as bytes and back, keys, and the
tiered store over a real mooncake_master (two clients in this process stand in for two instances)."""

from __future__ import annotations

import time

import pytest
import torch

from kvbench.contracts import Plan, PlanSegment
from kvbench.methods.api.base import MethodConfigError
from kvbench.methods.connector.remote_sources import RemoteSources, plan_sources
from kvbench.methods.connector.settings import ConnectorSettings
from kvbench.methods.core.entry_bytes import EntryError, EntryShape, entry_from_bytes, entry_to_bytes
from kvbench.methods.core.kv_codec import make_codec
from kvbench.methods.core.mooncake_tier import MooncakeTier, SharedTierSettings, TierCounts, shared_key
from kvbench.methods.core.store import CompressedKV, SavedKV
from kvbench.methods.core.tiered_store import TieredStore


def _entry(n: int = 24, hidden: bool = False) -> SavedKV:
    torch.manual_seed(n)
    entry = SavedKV(torch.arange(n), torch.randn(3, n, 2, 8), torch.randn(3, n, 2, 8), exact_rows=n - 4)
    if hidden:
        entry.hidden, entry.hidden_valid, entry.hidden_layer = torch.randn(n, 16), torch.arange(n) % 2 == 0, 1
    return entry


def test_keys_name_model_source_adapter_and_rank() -> None:
    key = shared_key("/models/llama", "run/t0/A0.r0", "role-b", 1, 2)
    assert key.startswith("kvbench/llama-") and key.endswith("/run/t0/A0.r0/role-b/tp1of2")
    assert shared_key("/a/llama", "k", None) != shared_key("/b/llama", "k", None)  # same folder name, other model
    assert shared_key("m", "k", None) != shared_key("m", "k", "role-b")


def test_an_entry_survives_bytes_and_anything_else_is_refused() -> None:
    entry = _entry(hidden=True)
    back = entry_from_bytes(entry_to_bytes(entry, "m"), "m", None)
    assert isinstance(back, SavedKV) and back.exact_rows == entry.exact_rows and back.hidden_layer == 1
    for name in ("token_ids", "k", "v", "hidden", "hidden_valid"):
        assert torch.equal(getattr(back, name), getattr(entry, name)), name
    codec = make_codec("polykv")
    compressed = CompressedKV.compress(entry, codec)
    kept = entry_from_bytes(entry_to_bytes(compressed, "m"), "m", codec)
    assert isinstance(kept, CompressedKV) and torch.equal(kept.decompress().v, compressed.decompress().v)
    value = entry_to_bytes(entry, "m")
    with pytest.raises(EntryError, match="written by model 'm', this server runs 'other'"):
        entry_from_bytes(value, "other", None)
    with pytest.raises(EntryError, match="kept with codec None, this store keeps 'polykv"):
        entry_from_bytes(value, "m", codec)
    for damaged in (value[:len(value) // 2], b"\x00" * 64, b""):
        with pytest.raises(EntryError):
            entry_from_bytes(damaged, "m", None)


def test_connector_settings_read_the_shared_tier() -> None:
    extra = {"method": "fullshared", "implementation": "x:Y"}
    tier = {"master": "h:1", "metadata": "http://h:2/metadata", "segment_bytes": 1 << 20}
    assert ConnectorSettings.from_extra_config({**extra, "shared_tier": tier}).shared_tier == SharedTierSettings(**tier)
    assert ConnectorSettings.from_extra_config(extra).shared_tier is None
    with pytest.raises(MethodConfigError, match="needs 'master'"):
        ConnectorSettings.from_extra_config({**extra, "shared_tier": {"master": "h:1"}})
    with pytest.raises(MethodConfigError, match="unknown shared_tier key"):
        ConnectorSettings.from_extra_config({**extra, "shared_tier": {**tier, "size": 1}})


@pytest.fixture(scope="module")
def tiers():
    """Two instances' clients (each lends the store memory) and a scheduler's (lends none), on a
    master started for the module; closed before the master goes (a client left open keeps trying
    to reach it; one lending memory takes about 2 s to give it back, so the module makes three)."""
    from kvbench.server.mooncake_master import MooncakeMaster

    pytest.importorskip("mooncake.store", reason="the [mooncake] extra (scripts/install.sh installs it)")
    with MooncakeMaster() as running:
        settings = running.address.tier_settings(64 << 20)
        clients = {"a": MooncakeTier(settings), "b": MooncakeTier(settings),
                   "lookup": MooncakeTier(settings, lend_memory=False)}
        yield clients
        for client in clients.values():
            client.close()


def _store(tiers, instance: str, model: str = "m", codec=None) -> TieredStore:
    """A fresh store on `instance`'s client (its counts zeroed)."""
    tier = tiers[instance]
    tier.counts = TierCounts()
    return TieredStore(1 << 30, codec, tier, model)


def test_a_source_saved_on_one_instance_is_read_on_another(tiers) -> None:
    writer, reader = _store(tiers, "a"), _store(tiers, "b")
    entry = _entry()
    writer.put("run/t0/A0.r0", entry, "role-a")
    assert writer.tier.counts.puts == 1 and writer.tier.counts.put_bytes > entry.nbytes // 2
    got = reader.get("run/t0/A0.r0", "role-a")
    assert got is not None and torch.equal(got.k, entry.k) and torch.equal(got.token_ids, entry.token_ids)
    assert reader.exact_entry("run/t0/A0.r0", "role-a") is not None  # kept locally: a local hit now
    counts = reader.tier.counts
    assert (counts.remote_hits, counts.local_hits, counts.misses, len(counts.get_s)) == (1, 1, 0, 1)
    assert reader.take_counts() == {"shared_remote_hits": 1, "shared_local_hits": 1,
                                    "shared_remote_bytes": counts.remote_bytes} and reader.take_counts() == {}
    assert _store(tiers, "b").get("run/t0/A0.r0", "role-b") is None  # no cache that adapter wrote
    other_model = _store(tiers, "b", model="other")
    assert other_model.get("run/t0/A0.r0", "role-a") is None and other_model.tier.counts.misses == 1
    writer.clear()  # a run's reset takes its entries out of the shared tier
    assert _store(tiers, "b").get("run/t0/A0.r0", "role-a") is None


def test_a_corrupt_remote_entry_is_counted_and_never_placed(tiers) -> None:
    reader = _store(tiers, "b")
    reader.tier.put(reader.key("run/t1/A0.r0", None), b"not an entry at all" * 10)
    assert reader.get("run/t1/A0.r0") is None
    assert (reader.tier.counts.rejected, reader.tier.counts.misses, reader.tier.counts.remote_hits) == (1, 1, 0)
    reader.clear()


def test_the_scheduler_holds_a_turn_back_until_its_remote_source_exists(tiers, monkeypatch) -> None:
    plan = Plan("t2", "A1.r0", "A1", "run/t2/A1.r0", segments=(
        PlanSegment("ph", "q", 0, 8, source="run/t2/A0.r0", source_start=0, source_adapter="role-a"),),
        prefix_sources=("run/t2/A1.x",), adapter="role-b")
    assert plan_sources(plan) == {"run/t2/A0.r0": "role-a", "run/t2/A1.x": "role-b"}
    remote = RemoteSources(tiers["lookup"], "m", 1)
    local = {"run/t2/A1.x"}  # ran here: the scheduler's own bookkeeping covers it
    assert remote.holds_back("r1", plan, local)  # not put yet: wait
    writer = _store(tiers, "a")
    writer.put("run/t2/A0.r0", _entry(), "role-a")
    assert not remote.holds_back("r1", plan, local)
    monkeypatch.setattr("kvbench.methods.connector.remote_sources.REMOTE_GRACE_S", 0.05)
    missing = Plan("t3", "A1.r0", "A1", "run/t3/A1.r0", segments=(
        PlanSegment("ph", "q", 0, 8, source="run/t3/A0.r0", source_start=0),))
    assert remote.holds_back("r2", missing, set())
    time.sleep(0.06)
    assert not remote.holds_back("r2", missing, set())  # a bounded wait: then the load computes
    writer.clear()


SHAPE = EntryShape(layers=3, kv_heads=2, head_dim=8, dtype=torch.float32)  # what _entry() holds


def _forged(header: object = None, **tensors: torch.Tensor) -> bytes:
    """An entry's bytes with its tensors or its header replaced (another writer's, or an attacker's)."""
    import json

    from safetensors.torch import save as save_tensors

    entry = _entry()
    parts = {"token_ids": entry.token_ids, "k": entry.k, "v": entry.v, **tensors}
    meta = {"layout": "kvbench-entry-1", "model": "m", "hidden_layer": None, "codec": None, "exact_rows": 4}
    return save_tensors({k: t.contiguous() for k, t in parts.items()},
                        metadata={"kvbench": json.dumps(meta if header is None else header)})


def test_a_shared_entry_is_placed_only_where_it_fits_the_readers_model() -> None:
    """Issue 66: headers that are not objects raised out of the store, a 1-D K raised IndexError,
    and 7 KV heads for a 2-head model, NaN K, float64 K/V, float token ids or exact_rows 10**30 or
    -5 were returned as placeable hits. Each is now a refused entry (the reader computes densely)."""
    n = 24
    assert entry_from_bytes(_forged(), "m", None, expect=SHAPE).num_tokens == n  # the honest entry passes
    nan_k = torch.randn(3, n, 2, 8)
    nan_k[1, 3, 0, 0] = float("nan")
    inf_v = torch.randn(3, n, 2, 8)
    inf_v[2, n - 1, 1, 7] = -float("inf")
    meta = {"layout": "kvbench-entry-1", "model": "m", "hidden_layer": None, "codec": None}
    forgeries = {
        "a JSON list header": _forged(header=[1, 2]),
        "a JSON string header": _forged(header="kvbench"),
        "1-D K": _forged(k=torch.randn(n), v=torch.randn(n)),
        "7 KV heads": _forged(k=torch.randn(3, n, 7, 8), v=torch.randn(3, n, 7, 8)),
        "another head size": _forged(k=torch.randn(3, n, 2, 16), v=torch.randn(3, n, 2, 16)),
        "other layers": _forged(k=torch.randn(5, n, 2, 8), v=torch.randn(5, n, 2, 8)),
        "NaN K": _forged(k=nan_k),
        "infinite V": _forged(v=inf_v),
        "float64 K/V": _forged(k=torch.randn(3, n, 2, 8, dtype=torch.float64), v=torch.randn(3, n, 2, 8, dtype=torch.float64)),
        "float token ids": _forged(token_ids=torch.arange(n, dtype=torch.float32)),
        "negative token ids": _forged(token_ids=-torch.arange(n)),
        "fewer token ids than rows": _forged(token_ids=torch.arange(n - 1)),
        "exact_rows 10**30": _forged(header={**meta, "exact_rows": 10**30}),
        "exact_rows -5": _forged(header={**meta, "exact_rows": -5}),
    }
    for what, value in forgeries.items():
        with pytest.raises(EntryError):
            entry_from_bytes(value, "m", None, expect=SHAPE)
            pytest.fail(f"{what}: placed")
    # without a reader's shape (a store not yet placed), the entry's own consistency still holds
    for what in ("a JSON list header", "1-D K", "exact_rows 10**30", "exact_rows -5", "fewer token ids than rows"):
        with pytest.raises(EntryError):
            entry_from_bytes(forgeries[what], "m", None)
            pytest.fail(f"{what}: placed without a shape")


def test_a_forged_remote_entry_is_counted_and_never_placed(tiers) -> None:
    reader = _store(tiers, "b")
    reader.placed_on("cpu", 0, 1, SHAPE)
    reader.tier.put(reader.key("run/t3/A0.r0", None), _forged(k=torch.randn(3, 24, 7, 8), v=torch.randn(3, 24, 7, 8)))
    reader.tier.put(reader.key("run/t3/A1.r0", None), _forged(header=["not", "an", "object"]))
    assert reader.get("run/t3/A0.r0") is None and reader.get("run/t3/A1.r0") is None
    assert (reader.tier.counts.rejected, reader.tier.counts.remote_hits) == (2, 0)
    writer = _store(tiers, "a")
    writer.put("run/t3/A2.r0", _entry())  # an honest one of the same model still arrives
    assert reader.get("run/t3/A2.r0") is not None and reader.tier.counts.remote_hits == 1
    reader.clear()
    writer.clear()
