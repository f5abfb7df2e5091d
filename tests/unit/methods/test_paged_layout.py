"""vLLM's CPU paged KV layout: rows written through the backend's own op read back exactly, on
the strided-copy path (token-major or transposed regions) and on the general gather path."""

from __future__ import annotations

import platform

import pytest
import torch

from kvbench.methods.core.paged import CpuPackedLayout


def _cpu_has(flag: str) -> bool:
    try:
        return flag in open("/proc/cpuinfo").read().split()
    except OSError:
        return False


# Each ISA's layout with a block size vLLM uses for it (AMX tiles need 32 rows), where this CPU has
# the ISA; one that fails to build there is a failure, not a skip.
ISAS = [
    pytest.param("vec", 16, id="vec"),
    pytest.param("vec16", 16, id="vec16"),
    pytest.param("amx", 32, id="amx", marks=pytest.mark.skipif(not _cpu_has("amx_tile"), reason="no AMX on this CPU")),
    pytest.param("neon", 16, id="neon", marks=pytest.mark.skipif(platform.machine() not in ("aarch64", "arm64"),
                                                                  reason="NEON is ARM's")),
]


@pytest.mark.parametrize("isa, bs", ISAS)
def test_rows_written_by_the_backend_read_back_exactly(isa: str, bs: int) -> None:
    layout = CpuPackedLayout(isa, bs, 32, torch.bfloat16)
    blocks, heads, hd = 12, 4, 32
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


def test_the_vec_layouts_take_the_fast_path() -> None:
    for isa in ("vec", "vec16"):  # every x86 build has them
        layout = CpuPackedLayout(isa, 16, 32, torch.bfloat16)
        assert (layout.k_order, layout.v_order) != ("gather", "gather"), isa
