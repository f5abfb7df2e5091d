"""vLLM's CPU paged KV layout: rows written through the backend's own op read back exactly, on
the strided-copy path (token-major or transposed regions) and on the general gather path."""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.paged import CpuPackedLayout


def _layouts() -> list[CpuPackedLayout]:
    found = []
    for isa in ("vec", "vec16", "amx", "neon"):
        try:
            found.append(CpuPackedLayout(isa, 16, 32, torch.bfloat16))
        except Exception:  # noqa: BLE001 - an ISA this CPU or build does not have
            continue
    return found


@pytest.mark.parametrize("layout", _layouts(), ids=lambda layout: layout.isa)
def test_rows_written_by_the_backend_read_back_exactly(layout: CpuPackedLayout) -> None:
    blocks, heads, bs, hd = 12, 4, 16, 32
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(blocks, heads, bs, 2 * hd, dtype=torch.bfloat16)
    block_ids = torch.tensor([7, 2, 9, 4])
    n = 57  # not a whole number of blocks
    slots = (block_ids[:, None] * bs + torch.arange(bs)).flatten()[:n]
    k = torch.randn(n, heads, hd, generator=g).bfloat16()
    v = torch.randn(n, heads, hd, generator=g).bfloat16()
    layout.write(cache, slots, k, v)
    read_k, read_v = layout.read(cache, block_ids, n)
    assert torch.equal(read_k, k) and torch.equal(read_v, v)
    # The general gather path reads the same rows (the strided-copy path is only a shortcut).
    layout.k_order = layout.v_order = "gather"
    gathered_k, gathered_v = layout.read(cache, block_ids, n)
    assert torch.equal(gathered_k, k) and torch.equal(gathered_v, v)


def test_this_cpu_has_a_layout_on_the_fast_path() -> None:
    layouts = _layouts()
    assert layouts, "no CPU attention ISA could be probed"
    assert any(order != "gather" for layout in layouts for order in (layout.k_order, layout.v_order))
