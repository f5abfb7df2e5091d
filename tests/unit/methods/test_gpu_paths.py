"""The correction path's tensor code gives the same results on a CUDA device as on the CPU.

The comparisons need a GPU and are skipped without one (CI has none); the parts that hold on any
device (a layout's round trip, a delta method accepting a content it has seen, a zero rotation)
run on the CPU in every tier. On a lent GPU: `python -m pytest --noconftest tests/unit/methods/test_gpu_paths.py`
(no vLLM needed)."""

from __future__ import annotations

from collections.abc import Generator

import pytest
import torch

from kvbench.contracts import Plan, PlanSegment
from kvbench.methods.api.base import LoadContext, SegmentReuse
from kvbench.methods.core.paged import KVHalvesLayout
from kvbench.methods.core.rope import RopeAligner
from kvbench.methods.core.store import SavedKV
from kvbench.methods.delta.anchors import Anchor, anchor_distances, gate_from_distances, interpolated_delta
from kvbench.methods.delta.stored import EXACT_EIGH_MAX_FEATURES, LowRank
from kvbench.methods.registry import method_class

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

LAYERS, TOKENS, HEADS, HEAD_DIM, RANK = 3, 200, 4, 64, 8
D = HEADS * HEAD_DIM


def caches(seed: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(LAYERS, TOKENS, D, generator=g)
    return [shared + 0.3 * torch.randn(LAYERS, TOKENS, D, generator=g) for _ in range(count)]


def pool_on(device: str) -> list[Anchor]:
    anchors = []
    for index, (k, v, dk, dv) in enumerate(zip(caches(1, 3), caches(2, 3), caches(3, 3), caches(4, 3), strict=True)):
        k, v, dk, dv = (t.to(device) for t in (k, v, dk, dv))
        anchor = Anchor(f"a{index}", "A0", LowRank(k, RANK, torch.bfloat16), LowRank(v, RANK, torch.bfloat16))
        anchor.deltas["A0->A1"] = (LowRank(0.1 * dk, RANK, torch.bfloat16), LowRank(0.1 * dv, RANK, torch.bfloat16))
        anchors.append(anchor)
    return anchors


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


@needs_cuda
@pytest.mark.parametrize("features", [D, 1024])  # full eigensolve; subspace iteration (Llama-3.1-8B's D)
def test_low_rank_reconstruction_matches_cpu(features: int) -> None:
    g = torch.Generator().manual_seed(5)
    u = torch.linalg.qr(torch.randn(LAYERS, 1200, features, generator=g))[0]
    v = torch.linalg.qr(torch.randn(LAYERS, features, features, generator=g))[0]
    z = (u / (1 + torch.arange(features)) ** 0.7) @ v.mT
    on_cpu, on_gpu = LowRank(z, RANK, torch.float32), LowRank(z.cuda(), RANK, torch.float32)
    assert on_gpu.a.is_cuda and on_gpu.b.is_cuda
    cpu_error = float((on_cpu.rows(1200) - z).norm() / z.norm())
    gpu_error = float((on_gpu.rows(1200).cpu() - z).norm() / z.norm())
    assert abs(gpu_error / cpu_error - 1) < 1e-3
    # Factors are unique up to sign (and, for subspace iteration, its random start); the product
    # of exact ones is not.
    if features <= EXACT_EIGH_MAX_FEATURES:
        assert relative(on_gpu.rows(1200), on_cpu.rows(1200)) < 1e-4


@needs_cuda
def test_distances_gate_and_interpolated_delta_match_cpu() -> None:
    cpu_pool, gpu_pool = pool_on("cpu"), pool_on("cuda")
    current_k, current_v = caches(6, 2)
    results = {}
    for device, pool in (("cpu", cpu_pool), ("cuda", gpu_pool)):
        k, v = current_k.to(device, torch.bfloat16), current_v.to(device, torch.bfloat16)
        sums, squares = anchor_distances(v, [a.base_v for a in pool], TOKENS, gate_rows=TOKENS // 2)
        gate = gate_from_distances(squares, 0.9)
        delta_k, delta_v = interpolated_delta(k, v, pool, "A0->A1", TOKENS, value_distances=sums)
        assert delta_k.device.type == device
        results[device] = (sums, squares, gate, delta_k, delta_v)
    (c_sums, c_squares, c_gate, c_dk, c_dv), (g_sums, g_squares, g_gate, g_dk, g_dv) = results["cpu"], results["cuda"]
    assert relative(g_sums, c_sums) < 2e-2 and relative(g_squares, c_squares) < 2e-2
    assert g_gate.accept == c_gate.accept
    assert abs(g_gate.normalized_entropy - c_gate.normalized_entropy) < 2e-2
    assert relative(g_dk, c_dk) < 2e-2 and relative(g_dv, c_dv) < 2e-2


@needs_cuda
@pytest.mark.parametrize("rank", [8, 24, 32])  # padded to tl.dot's 16 and to a power of two
def test_fused_distances_equal_the_torch_paths(rank: int) -> None:
    g = torch.Generator().manual_seed(7)
    stored = [LowRank.from_factors(torch.randn(LAYERS, 300, rank, generator=g).bfloat16().cuda(),
                                   (torch.randn(LAYERS, rank, D, generator=g) / rank**0.5).bfloat16().cuda())
              for _ in range(5)]
    current = torch.randn(LAYERS, 310, D, generator=g).bfloat16().cuda()
    n = 257  # not a multiple of the kernel's 64-row blocks
    for gate_rows, per_token in ((100, True), (n, True), (60, False)):
        loop = anchor_distances(current, stored, n, gate_rows, per_token, path="loop")
        for path in ("batched", "fused"):
            sums, squares = anchor_distances(current, stored, n, gate_rows, per_token, path=path)
            assert sums.shape == loop[0].shape and squares.shape == (5,)
            assert torch.allclose(sums, loop[0], rtol=1e-2) and torch.allclose(squares, loop[1], rtol=1e-2)
    fused = anchor_distances(current, stored, n, path="fused")[0]
    assert torch.equal(anchor_distances(current, stored, n)[0], fused)  # the default path on CUDA is the fused one


@needs_cuda
@pytest.mark.parametrize("exact", [True, False])
def test_rotation_matches_cpu(exact: bool) -> None:
    keys = torch.randn(TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    aligner = RopeAligner.from_theta(HEAD_DIM, 4096, 500000.0)
    on_cpu = aligner.rotate(keys, 1234, exact=exact)
    on_gpu = aligner.to("cuda").rotate(keys.cuda(), 1234, exact=exact)
    assert on_gpu.is_cuda
    assert relative(on_gpu, on_cpu) < (1e-2 if exact else 2e-2)
    per_row = aligner.rotate(keys.cuda(), torch.arange(TOKENS, device="cuda"), exact=exact)
    assert relative(per_row[0], keys[0]) < 1e-2  # a shift of zero positions leaves the row as it was


def test_a_zero_shift_leaves_keys_as_they_were() -> None:
    keys = torch.randn(TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    aligner = RopeAligner.from_theta(HEAD_DIM, 4096, 500000.0)
    for exact in (True, False):
        assert relative(aligner.rotate(keys, 0, exact=exact), keys) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("physical", [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3)])  # HND, NHD, heads outermost
def test_halves_layout_round_trip(device: str, physical: tuple[int, ...]) -> None:
    """vLLM 0.32's GPU cache [blocks, heads, block_size, 2 x head_dim] stored in several physical
    orders (tests/unit/methods/test_kv_layouts.py covers every KVCacheLayout through vLLM's own allocator):
    rows written to slots read back in block order, on either device."""
    blocks, block_size = 8, 16
    logical = (blocks, HEADS, block_size, 2 * HEAD_DIM)
    storage = torch.zeros([logical[i] for i in physical], dtype=torch.bfloat16, device=device)
    kv_cache = storage.permute(*[physical.index(i) for i in range(4)])
    assert tuple(kv_cache.shape) == logical
    block_ids = torch.tensor([5, 2, 7])
    n = 40
    slots = torch.cat([b * block_size + torch.arange(block_size) for b in block_ids.tolist()])[:n]
    k = torch.randn(n, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    v = torch.randn(n, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    layout = KVHalvesLayout(HEAD_DIM)
    layout.write(kv_cache, slots, k.to(device), v.to(device))
    read_k, read_v = layout.read(kv_cache, block_ids, n)
    assert torch.equal(read_k.cpu(), k) and torch.equal(read_v.cpu(), v)
    assert int((kv_cache != 0).any(dim=(1, 2, 3)).sum()) == 3  # only the three named blocks


class _Core:
    """What a delta method asks of the connector core, on one device (no engine)."""

    tensor_parallel_size = 1

    def __init__(self, device: str) -> None:
        self.aligner = RopeAligner.from_theta(HEAD_DIM, 20000, 10000.0).to(device)
        self.device = device

    def sum_over_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def shared_state(self, namespace: str) -> None:
        return None  # one instance

    def computed(self, req_id: str) -> bool:
        return True  # each load here is computed before the next: deferred work runs at once

    def context_free_prefill_steps(self, tokens: torch.Tensor) -> Generator[int, None, SavedKV]:
        yield from ()  # no pauses: methods here run each load whole
        g = torch.Generator().manual_seed(int(tokens.sum()))
        k, v = (torch.randn(LAYERS, len(tokens), HEADS, HEAD_DIM, generator=g) for _ in range(2))
        return SavedKV(tokens.clone(), k.to(self.device, torch.bfloat16), v.to(self.device, torch.bfloat16))


def _load(device: str, seed: int, scattered: bool) -> tuple[LoadContext, SegmentReuse]:
    """A1's load: q (96 tokens at position 10) reused from A0's bf16 cache on `device`, where q sat
    at position 7 (contiguous rows) or at every other row (scattered: the index_select path)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(LAYERS, 300, HEADS, HEAD_DIM, generator=g)  # content-specific part
    source = SavedKV(torch.arange(300), (shared + 0.1 * torch.randn(shared.shape, generator=g)).to(device, torch.bfloat16),
                     (shared + 0.1 * torch.randn(shared.shape, generator=g)).to(device, torch.bfloat16))
    segment = PlanSegment("ph", "q", 10, 96, source="run/t/A0.r0", source_start=7, source_agent="A0")
    plan = Plan(f"t{seed}", "A1.r0", "A1", f"run/t{seed}/A1.r0", (PlanSegment("pf", "system", 0, 10), segment))
    dst = torch.arange(10, 106)
    src = 7 + 2 * torch.arange(96) if scattered else dst - 10 + 7
    dense_k = source.k[:, 7:203].float().cpu() + 0.05
    dense_v = source.v[:, 7:203].float().cpu() - 0.05
    return (LoadContext(plan.save_as, plan, torch.arange(120) + 1000 * seed, 0,
                        [SegmentReuse(segment, source, dst, src)],
                        read_rows=lambda rows: (dense_k[:, rows].to(device), dense_v[:, rows].to(device))),
            SegmentReuse(segment, source, dst, src))


def _seen_content_corrected(name: str, scattered: bool, device: str) -> tuple[torch.Tensor, torch.Tensor, str, int]:
    """Dense fallbacks build anchors (factorized on the device), then a content seen before is
    accepted and corrected: the corrected rows of layer 2, the decision and the pool's bytes."""
    method = method_class(name)({})
    method.bind(_Core(device))
    for seed in (1, 2, 3):  # three contents, each computed densely and kept as an anchor
        ctx, _ = _load(device, seed, scattered)  # (GraphFlow: the first calibrates its relation)
        assert (method.select(ctx) == []) == (seed == 1 or name != "graphflow")
        method.after_load(ctx)
        method.run_deferred()
    ctx, _ = _load(device, 2, scattered)  # content seen before
    chosen = method.select(ctx)
    decision = ctx.stats["decisions"][0]
    assert len(chosen) == 1, decision
    reuse = chosen[0]
    index = reuse.src.to(reuse.source.k.device)
    keys, values = method.correct(2, reuse, reuse.source.k[2, index].clone(), reuse.source.v[2, index].clone())
    assert keys.device.type == device and values.device.type == device
    return keys, values, decision["decision"], method.state_bytes()["anchor_pool"]


DELTA_METHODS = ["kvcmas", "kvcmas-nonchained", "kvcomm", "graphflow"]


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("name", DELTA_METHODS)
def test_delta_methods_accept_and_correct_a_content_they_have_seen(name: str, scattered: bool) -> None:
    keys, values, decision, pool_bytes = _seen_content_corrected(name, scattered, "cpu")
    assert decision == "accepted" and pool_bytes > 0
    assert keys.shape == values.shape == (96, HEADS, HEAD_DIM) and torch.isfinite(keys.float()).all()


@needs_cuda
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("name", DELTA_METHODS)
def test_delta_methods_run_on_cuda_as_on_cpu(name: str, scattered: bool) -> None:
    """The decisions match the CPU run's and the corrected rows agree in bf16."""
    corrected = {device: _seen_content_corrected(name, scattered, device) for device in ("cpu", "cuda")}
    (cpu_k, cpu_v, cpu_decision, cpu_bytes), (gpu_k, gpu_v, gpu_decision, gpu_bytes) = corrected["cpu"], corrected["cuda"]
    assert gpu_decision == cpu_decision == "accepted" and gpu_bytes == cpu_bytes > 0
    assert relative(gpu_k, cpu_k) < 2e-2 and relative(gpu_v, cpu_v) < 2e-2
