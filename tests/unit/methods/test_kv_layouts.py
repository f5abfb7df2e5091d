"""The GPU backends' KV caches as vLLM 0.32 allocates them (its own `create_kv_cache_views`, for
every `KVCacheLayout` permutation), on the CPU: rows kvbench writes read back through the
backend's own view (`kv_cache.transpose(1, 2).split(head_size, -1)`, as FlashAttention's forward
reads it) and the other way round; quantized caches and other shapes are refused by name."""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.core.paged import KVHalvesLayout, UnsupportedCacheError, layout_for

vllm_layout = pytest.importorskip("vllm.v1.kv_cache_layout")
interface = pytest.importorskip("vllm.v1.kv_cache_interface")
LAYOUTS = list(vllm_layout.KVCacheLayout)
NUM_BLOCKS, NUM_LAYERS = 12, 3


def vllm_caches(layout, block_size: int, heads: int, head_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every layer's cache view, allocated as vLLM 0.32's worker does for `layout` (layers may
    interleave inside one buffer)."""
    spec = interface.FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    layer_stride, block_stride, *_ = interface.compute_layout_strides(spec, NUM_BLOCKS, NUM_LAYERS, layout)
    size = NUM_LAYERS * NUM_BLOCKS * spec.page_size_bytes
    tensor = interface.KVCacheTensor(size=size, layers=[f"layer{i}" for i in range(NUM_LAYERS)],
                                     layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return interface.create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)


def backend_view(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM 0.32's FlashAttention forward reads: [blocks, block size, heads, head size] each."""
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


CASES = [(16, 8, 64, torch.bfloat16), (32, 2, 128, torch.float16), (16, 1, 32, torch.float32),
         (16, 4, 64, torch.bfloat16)]  # 4 heads: a rank's half of 8 under tensor parallelism


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("block_size, heads, head_size, dtype", CASES)
def test_rows_written_by_kvbench_read_back_through_the_backends_view(layout, block_size: int, heads: int,
                                                                        head_size: int, dtype: torch.dtype) -> None:
    caches = vllm_caches(layout, block_size, heads, head_size, dtype)
    assert tuple(caches[0].shape) == (NUM_BLOCKS, heads, block_size, 2 * head_size)
    generator = torch.Generator().manual_seed(block_size + heads)
    kvbench = KVHalvesLayout(head_size)
    slots = torch.tensor([5 * block_size + 3, 2 * block_size, 2 * block_size + 1, 11 * block_size + block_size - 1])
    rows = {name: torch.randn(len(slots), heads, head_size, generator=generator).to(dtype) for name in ("k", "v")}
    kvbench.write(caches[1], slots, rows["k"], rows["v"])
    key_cache, value_cache = backend_view(caches[1], head_size)
    for index, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(key_cache[block, offset], rows["k"][index])
        assert torch.equal(value_cache[block, offset], rows["v"][index])
    # nothing else moved: the other layers (which may share the buffer) and the other slots
    for other in (caches[0], caches[2]):
        assert not other.float().any()
    assert int((caches[1].float() != 0).any(dim=(1, 3)).sum()) == len(slots)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("block_size, heads, head_size, dtype", CASES[:2])
def test_rows_the_backend_wrote_are_read_by_kvbench_in_block_table_order(layout, block_size: int, heads: int,
                                                                         head_size: int, dtype: torch.dtype) -> None:
    kv_cache = vllm_caches(layout, block_size, heads, head_size, dtype)[2]
    key_cache, value_cache = backend_view(kv_cache, head_size)
    block_table = torch.tensor([7, 0, 9])
    n = 2 * block_size + 5
    generator = torch.Generator().manual_seed(3)
    k = torch.randn(n, heads, head_size, generator=generator).to(dtype)
    v = torch.randn(n, heads, head_size, generator=generator).to(dtype)
    for token in range(n):  # as the backend's reshape_and_cache places token t of the request
        block, offset = block_table[token // block_size], token % block_size
        key_cache[block, offset], value_cache[block, offset] = k[token], v[token]
    read_k, read_v = KVHalvesLayout(head_size).read(kv_cache, block_table, n)
    assert torch.equal(read_k, k) and torch.equal(read_v, v)


def test_swapped_halves_are_caught() -> None:
    """The check this file rests on: a layout that put V where K goes would fail it."""

    class Swapped(KVHalvesLayout):
        def write(self, kv_cache, slots, k, v):  # type: ignore[no-untyped-def]
            super().write(kv_cache, slots, v, k)

    kv_cache = vllm_caches(LAYOUTS[0], 16, 2, 32, torch.bfloat16)[0]
    k, v = torch.ones(1, 2, 32, dtype=torch.bfloat16), torch.full((1, 2, 32), 2.0, dtype=torch.bfloat16)
    Swapped(32).write(kv_cache, torch.tensor([3]), k, v)
    assert not torch.equal(backend_view(kv_cache, 32)[0][0, 3], k[0])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_a_quantized_cache_is_refused_with_what_to_change(dtype: torch.dtype) -> None:
    with pytest.raises(UnsupportedCacheError, match="--kv-cache-dtype auto"):
        layout_for(torch.zeros(4, 2, 16, 64).to(dtype), None, "FLASH_ATTN")


@pytest.mark.parametrize("shape", [(4, 16, 576), (2, 4, 16, 2, 64), (4, 2, 16, 63)])
def test_other_shapes_are_refused_naming_the_backend_and_the_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(UnsupportedCacheError, match=rf"FLASHMLA attention backend .*{shape[0]}, {shape[1]}"):
        layout_for(torch.zeros(shape, dtype=torch.bfloat16), None, "FLASHMLA")


def test_a_cache_off_the_cpu_gets_the_halves_layout() -> None:
    """layout_for's device path, seen without a GPU through a meta tensor of FlashAttention's shape."""
    layout = layout_for(torch.empty(16, 8, 16, 256, dtype=torch.bfloat16, device="meta"), None, "FLASH_ATTN")
    assert isinstance(layout, KVHalvesLayout) and layout.head_size == 128
