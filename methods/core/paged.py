"""Reading and writing arbitrary token rows of vLLM's paged KV cache, per backend layout."""

from __future__ import annotations

from typing import Protocol

import torch


class PagedLayout(Protocol):
    def read(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n, Hkv, hd] of a request's tokens 0..n-1."""

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K, V [m, Hkv, hd] at flat slots (block_id * block_size + offset)."""


def cpu_cache_halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU_ATTN views [nb, Hkv, bs, 2*hd] as [nb, Hkv, 2*bs, hd]: K region, then V region."""
    nb, heads, bs, two_hd = kv_cache.shape
    return kv_cache.view(nb, heads, 2 * bs, two_hd // 2).chunk(2, dim=2)


class CpuPackedLayout:
    """vLLM's CPU attention backend stores each (block, head) region in an ISA-specific order
    (transposed for vec ISAs, VNNI tiles for AMX). Rather than hard-code those orders, derive the
    permutation once by writing index-encoded values through the backend's own
    `cpu_attn_reshape_and_cache` and reading where they landed; writes always go through that op."""

    def __init__(self, isa: str, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
        from vllm import _custom_ops as ops

        self.isa, self.block_size, self.head_dim, self.dtype = isa, block_size, head_dim, dtype
        n = block_size * head_dim
        if n > 65536:
            raise ValueError(f"block_size * head_dim = {n} is too large for the layout probe")
        index = torch.arange(n)
        slots = torch.arange(block_size, dtype=torch.long)

        def probe(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cache = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
            k_half, v_half = cpu_cache_halves(cache)
            encoded = values.to(dtype).view(block_size, 1, head_dim)
            ops.cpu_attn_reshape_and_cache(encoded, encoded, k_half, v_half, slots, isa)
            flat = cache.view(2, n).float()
            return flat[0], flat[1]

        # Two bytes per index, each exactly representable in bf16/fp16.
        k_lo, v_lo = probe(index % 256)
        k_hi, v_hi = probe(index // 256)
        self.k_perm = torch.empty(n, dtype=torch.long)
        self.v_perm = torch.empty(n, dtype=torch.long)
        self.k_perm[(k_hi * 256 + k_lo).long()] = torch.arange(n)  # logical (t*hd+d) -> physical
        self.v_perm[(v_hi * 256 + v_lo).long()] = torch.arange(n)
        for perm in (self.k_perm, self.v_perm):
            if not torch.equal(perm.sort().values, torch.arange(n)):
                raise RuntimeError(f"could not derive the CPU paged layout for isa={isa}")
        # Orders a strided copy can read (measured: a gather over the last dimension took 1.3 ms
        # of the 4 ms per layer of an 8K save): token-major rows, or the transposed [hd, bs]
        # region the vec ISAs use for K. Anything else (AMX tiles) goes through the gather.
        rows = torch.arange(n)
        transposed = rows.view(head_dim, block_size).t().flatten()
        self.k_order, self.v_order = ("rows" if torch.equal(perm, rows) else
                                      "transposed" if torch.equal(perm, transposed) else "gather"
                                      for perm in (self.k_perm, self.v_perm))

    def _region(self, region: torch.Tensor, perm: torch.Tensor, order: str, n: int) -> torch.Tensor:
        """One half of gathered blocks [blocks, heads, bs*hd] as rows [n, heads, hd], in one copy."""
        blocks, heads = region.shape[:2]
        bs, hd = self.block_size, self.head_dim
        if order == "rows":
            x = region.view(blocks, heads, bs, hd).permute(0, 2, 1, 3)
        elif order == "transposed":
            x = region.view(blocks, heads, hd, bs).permute(0, 3, 1, 2)
        else:
            x = region.index_select(-1, perm).view(blocks, heads, bs, hd).permute(0, 2, 1, 3)
        return x.reshape(blocks * bs, heads, hd)[:n]

    def read(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        nb, heads, bs, two_hd = kv_cache.shape
        hd = two_hd // 2
        num_blocks = (n + bs - 1) // bs
        blocks = kv_cache.view(nb, heads, 2, bs * hd).index_select(0, block_ids[:num_blocks])
        return (self._region(blocks[:, :, 0], self.k_perm, self.k_order, n),
                self._region(blocks[:, :, 1], self.v_perm, self.v_order, n))

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        if len(slots) == 0:
            return
        k_half, v_half = cpu_cache_halves(kv_cache)
        ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), k_half, v_half, slots, self.isa)


class KVHalvesLayout:
    """vLLM 0.32's GPU attention backends (FlashAttention, Triton, FlashInfer): each layer's cache
    is a view of logical shape [blocks, Hkv, block_size, 2 * head_size], keys then values in the
    last dimension (what their forward reads as `kv_cache.transpose(1, 2).split(head_size, -1)`),
    whose strides are the permutation of `vllm.v1.kv_cache_layout.KVCacheLayout` vLLM chose
    (several layers may interleave in one buffer). Read and written through the logical view, so
    every permutation is served alike; the physical order is vLLM's business."""

    def __init__(self, head_size: int) -> None:
        self.head_size = head_size

    def read(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, heads, bs, _ = kv_cache.shape
        num_blocks = (n + bs - 1) // bs
        blocks = kv_cache.index_select(0, block_ids[:num_blocks].to(kv_cache.device))  # [nb, H, bs, 2hd], one copy
        rows = blocks.transpose(1, 2).reshape(num_blocks * bs, heads, 2 * self.head_size)[:n]
        return rows[..., :self.head_size], rows[..., self.head_size:]

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if len(slots) == 0:
            return
        slots = slots.to(kv_cache.device)
        bs = kv_cache.shape[2]
        blocks, offsets = slots // bs, slots % bs
        # advanced indices on blocks and offsets, apart: the result is [m, Hkv, head_size]
        kv_cache[blocks, :, offsets, :self.head_size] = k.to(kv_cache.dtype)
        kv_cache[blocks, :, offsets, self.head_size:] = v.to(kv_cache.dtype)


# dtypes vLLM stores quantized caches in: rows written here would need the layer's scales
QUANTIZED_CACHE_DTYPES = {torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2}


class UnsupportedCacheError(ValueError):
    """A layer's cache kvbench's connector cannot read or write (refused when the caches are registered)."""


def layout_for(kv_cache: torch.Tensor, isa: str | None, backend: str = "?") -> PagedLayout:
    """The layout of one layer's cache tensor as vLLM allocated it; UnsupportedCacheError naming
    the backend and the shape for any other (MLA's latent cache, a hybrid model's state, fp8)."""
    shape = tuple(kv_cache.shape)
    if kv_cache.dtype in QUANTIZED_CACHE_DTYPES:
        raise UnsupportedCacheError(
            f"the {backend} attention backend stores this layer's KV cache as {kv_cache.dtype} (a quantized "
            "--kv-cache-dtype): kvbench's connector writes rows at the model's precision and would need the "
            "layer's scales; serve with --kv-cache-dtype auto")
    if kv_cache.dim() != 4 or shape[3] % 2:
        raise UnsupportedCacheError(
            f"the {backend} attention backend hands kvbench a KV cache of shape {shape}; kvbench's connector "
            "reads [blocks, kv heads, block size, 2 x head size] caches (vLLM 0.32's FlashAttention, Triton and "
            "FlashInfer backends, and its CPU backend), not an MLA latent cache or a hybrid model's state")
    if kv_cache.device.type == "cpu":
        if isa is None:
            raise UnsupportedCacheError(f"the CPU attention layer ({backend}) has no ISA set; is this the CPU_ATTN "
                                        "backend?")
        return CpuPackedLayout(isa, shape[2], shape[3] // 2, kv_cache.dtype)
    return KVHalvesLayout(shape[3] // 2)


def read_rows(caches: list[tuple[PagedLayout, torch.Tensor]], block_ids: torch.Tensor, rows: torch.Tensor,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [layers, len(rows), Hkv, hd] of a request's `rows` (any order) from its paged blocks,
    one (layout, cache) per layer: only the blocks holding them are read (a few output rows at the
    end of a long prompt read a block, not the prompt: 15 ms a turn on the CPU backend before)."""
    host_rows = rows.cpu()
    needed, inverse = torch.unique(torch.div(host_rows, block_size, rounding_mode="floor"), return_inverse=True)
    local = inverse * block_size + host_rows % block_size  # each row's place in the blocks read, in their order
    blocks, n_read = block_ids.cpu()[needed], len(needed) * block_size
    ks, vs = [], []
    for layout, cache in caches:
        k, v = layout.read(cache, blocks, n_read)
        index = local.to(k.device)
        ks.append(k.index_select(0, index))
        vs.append(v.index_select(0, index))
    return torch.stack(ks), torch.stack(vs)
