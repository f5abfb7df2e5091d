"""PReCache's methods without an engine: the adapters' value terms, the LR cache and the rebuilt
values (kvbench.methods.precache.base, kvbench.methods.core.lora)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvbench.contracts import Plan, PlanSegment
from kvbench.methods.api.base import MethodConfigError, SegmentReuse
from kvbench.methods.connector.settings import ConnectorSettings
from kvbench.methods.core.forward import run_to_end
from kvbench.methods.core.lora import VLora, load_v_lora
from kvbench.methods.core.store import SavedKV
from kvbench.methods.precache.base import LowRankReuse
from kvbench.methods.registry import method_class, method_keys
from kvbench.model.adapters import PEFT_CONFIG, build_random_adapter

LAYERS, HIDDEN, KV_HEADS, HEAD_DIM, RANK = 3, 16, 2, 4, 8


class FakeCore:
    """A model whose value projection is W_v X with X the token's embedding, one per layer."""

    def __init__(self, adapters: dict[str, VLora]) -> None:
        generator = torch.Generator().manual_seed(0)
        self._adapters = adapters
        self.num_layers = LAYERS
        self.embedding = torch.randn(64, HIDDEN, generator=generator)
        self.w_v = torch.randn(LAYERS, KV_HEADS * HEAD_DIM, HIDDEN, generator=generator)

    @property
    def adapters(self) -> dict[str, VLora]:
        return dict(self._adapters)

    def adapter(self, name: str | None) -> VLora | None:
        if name is None:
            return None
        if name not in self._adapters:
            raise MethodConfigError(f"adapter {name!r} was not given")
        return self._adapters[name]

    def values(self, tokens: torch.Tensor, adapter: str | None) -> torch.Tensor:
        x = self.embedding[tokens]
        lora = self.adapter(adapter)
        out = []
        for layer in range(LAYERS):
            v = x @ self.w_v[layer].T
            if lora is not None:
                v = v + lora.value_term(layer, lora.low_rank(layer, x))
            out.append(v.reshape(len(tokens), KV_HEADS, HEAD_DIM))
        return torch.stack(out)

    def context_free_prefill_steps(self, tokens, adapter=None, value_inputs=None):
        x = self.embedding[tokens]
        for layer in range(LAYERS):
            if value_inputs is not None:
                value_inputs(layer, x)
            yield len(tokens)
        keys = torch.zeros(LAYERS, len(tokens), KV_HEADS, HEAD_DIM)
        return SavedKV(tokens.clone(), keys, self.values(tokens, adapter))


def _lora(name: str, seed: int, zero: bool = False) -> VLora:
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(LAYERS, RANK, HIDDEN, generator=generator)
    b = torch.zeros(LAYERS, KV_HEADS * HEAD_DIM, RANK) if zero else torch.randn(LAYERS, KV_HEADS * HEAD_DIM, RANK,
                                                                                  generator=generator)
    return VLora(name, a, b, scaling=2.0)


def _load(method_name: str, core: FakeCore, reader: str | None, writer: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A reader's values of a source's rows 2..9 as the method rebuilds them, and its own values."""
    method = method_class(method_name)({})
    method.bind(core)  # type: ignore[arg-type]
    tokens = torch.arange(12)
    saved = SavedKV(tokens, torch.zeros(LAYERS, 12, KV_HEADS, HEAD_DIM), core.values(tokens, writer))
    method.after_save("src", saved, writer)
    method.run_deferred()  # the lazy build, after the source's save
    segment = PlanSegment(id="q", kind="ph", start=0, length=8, source="src", source_start=2, source_adapter=writer)
    reuse = SegmentReuse(segment, saved, torch.arange(8), torch.arange(2, 10))

    class Ctx:
        plan = Plan(trajectory="t", turn="A1", agent="A1", save_as=None, segments=(segment,), adapter=reader)
        candidates = [reuse]
        stats: dict = {}

    run_to_end(method.prepare(Ctx))  # type: ignore[arg-type]
    assert "precache_built_tokens" not in Ctx.stats  # built after the save, not at the load
    [chosen] = method.select(Ctx)  # type: ignore[arg-type]
    assert isinstance(chosen, LowRankReuse)
    assert Ctx.stats["lr_cache_bytes_per_token_adapter"] == 4 * RANK * LAYERS  # fp32 here: 4 bytes
    rebuilt = torch.stack([method.correct(layer, chosen, chosen.source.k[layer, chosen.src].clone(),
                                          chosen.source.v[layer, chosen.src].clone())[1] for layer in range(LAYERS)])
    return rebuilt, core.values(tokens, reader)[:, 2:10]


@pytest.mark.parametrize("method", ["precache-prelr", "precache-rebase"])
def test_a_reader_gets_its_own_adapters_values_from_another_adapters_cache(method: str) -> None:
    core = FakeCore({"writer": _lora("writer", 1), "reader": _lora("reader", 2)})
    rebuilt, own = _load(method, core, reader="reader", writer="writer")
    assert torch.allclose(rebuilt, own, rtol=1e-4, atol=1e-3)
    rebuilt, own = _load(method, core, reader=None, writer="writer")  # the base model reads a writer's cache
    assert torch.allclose(rebuilt, own, rtol=1e-4, atol=1e-3)


def test_rebase_with_a_zero_reader_adapter_places_the_adapter_free_values() -> None:
    """The writer's adapter is not zero, so its cache's values differ from the base model's: a
    reader whose adapter adds nothing gets the base values, not the writer's."""
    core = FakeCore({"writer": _lora("writer", 1), "reader": _lora("reader", 2, zero=True)})
    tokens = torch.arange(12)
    base, writers = core.values(tokens, None)[:, 2:10], core.values(tokens, "writer")[:, 2:10]
    assert not torch.allclose(base, writers, atol=1e-2)
    rebuilt, _ = _load("precache-rebase", core, reader="reader", writer="writer")
    assert torch.allclose(rebuilt, base, rtol=1e-4, atol=1e-4)


def test_state_counts_lr_caches_and_rebase_base_caches() -> None:
    core = FakeCore({"writer": _lora("writer", 1), "reader": _lora("reader", 2)})
    for name, has_base in (("precache-prelr", False), ("precache-rebase", True)):
        method = method_class(name)({})
        method.bind(core)  # type: ignore[arg-type]
        tokens = torch.arange(12)
        method.after_save("src", SavedKV(tokens, torch.zeros(LAYERS, 12, KV_HEADS, HEAD_DIM),
                                         core.values(tokens, "writer")), "writer")
        method.run_deferred()
        state = method.state_bytes()
        assert state["lr_cache"] == 2 * 12 * LAYERS * RANK * 4  # two adapters, fp32
        assert (state["base_cache"] > 0) == has_base
        method.reset()
        assert method.state_bytes()["lr_cache"] == 0


def test_a_reader_adapter_the_connector_lacks_is_refused_at_its_load() -> None:
    core = FakeCore({"writer": _lora("writer", 1)})
    with pytest.raises(MethodConfigError, match="'stranger' was not given"):
        _load("precache-rebase", core, reader="stranger", writer="writer")


def test_load_v_lora_reads_peft_folders_and_refuses_adapters_beyond_v_proj(default_model: str, tmp_path: Path) -> None:
    folder = build_random_adapter(default_model, tmp_path / "v-only", rank=8, seed=3)
    config = json.loads((Path(default_model) / "config.json").read_text())
    kv_rows = config["num_key_value_heads"] * config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    lora = load_v_lora("v-only", folder, config["num_hidden_layers"], slice(0, kv_rows // 2))
    assert lora.a.shape == (config["num_hidden_layers"], 8, config["hidden_size"])
    assert lora.b.shape == (config["num_hidden_layers"], kv_rows // 2, 8)  # this rank's KV heads only
    assert lora.scaling == 2.0
    peft = json.loads((folder / PEFT_CONFIG).read_text())
    (folder / PEFT_CONFIG).write_text(json.dumps({**peft, "target_modules": ["q_proj", "v_proj"]}))
    with pytest.raises(MethodConfigError, match="not V-only"):
        load_v_lora("v-only", folder, config["num_hidden_layers"], slice(0, kv_rows))


def test_connector_settings_take_the_served_adapters() -> None:
    settings = ConnectorSettings.from_extra_config({**method_keys("precache-rebase"), "adapters": {"a": "/x/a"}})
    assert settings.adapters == {"a": "/x/a"}
    with pytest.raises(MethodConfigError, match="adapters must map"):
        ConnectorSettings.from_extra_config({**method_keys("precache-rebase"), "adapters": ["/x/a"]})


def test_a_plans_exact_sources_are_the_caches_written_under_its_adapter() -> None:
    """What the connector may copy from (the copy itself: tests/unit/methods/test_connector_units.py)."""
    own = PlanSegment(id="q", kind="ph", start=0, length=4, source="k1", source_start=0, source_adapter="a")
    other = PlanSegment(id="r", kind="ph", start=4, length=4, source="k2", source_start=0, source_adapter="b")
    plan = Plan(trajectory="t", turn="A1", agent="A1", save_as=None, segments=(own, other), adapter="a",
                prefix_sources=("k0",))
    assert plan.exact_sources == {"k0", "k1"}
    assert plan.waits_for == {"k0", "k1", "k2"}
