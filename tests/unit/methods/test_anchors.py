"""Anchor pools and delta-correction methods, on tensors (no engine)."""

from __future__ import annotations

import math
from collections.abc import Generator

import pytest
import torch

from kvbench.contracts import Plan, PlanSegment
from kvbench.methods.api.base import LoadContext, SegmentReuse
from kvbench.methods.core.rope import RopeAligner
from kvbench.methods.core.store import SavedKV
from kvbench.methods.delta.anchors import (
    AnchorPool,
    Correction,
    anchor_distances,
    gate_from_distances,
    interpolated_delta,
    reliability_gate,
)
from kvbench.methods.delta.stored import EXACT_EIGH_MAX_FEATURES, FullRank, LowRank
from kvbench.methods.registry import method_class

LAYERS, HEADS, HEAD_DIM = 4, 4, 32
D = HEADS * HEAD_DIM


def _low_rank_plus_noise(n: int, rank: int, noise: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(LAYERS, n, rank, generator=g) @ torch.randn(LAYERS, rank, D, generator=g)
            + noise * torch.randn(LAYERS, n, D, generator=g))


def test_factorization_error_falls_with_rank() -> None:
    z = _low_rank_plus_noise(300, 24, 0.05, seed=1)
    errors = [float((LowRank(z, r, torch.float32).rows(300) - z).norm() / z.norm()) for r in (2, 8, 24, D)]
    assert errors == sorted(errors, reverse=True) and errors[0] > 0.3
    assert errors[2] < 0.05 and errors[3] < 1e-5  # rank 24 captures the signal; full rank is exact


def test_factorization_is_the_optimal_truncation() -> None:
    """The Gram-matrix factors reconstruct exactly as well as a truncated SVD (Eckart-Young), also
    for segments shorter than the feature dimension."""
    for n in (300, 40):
        z = _low_rank_plus_noise(n, 24, 0.2, seed=2)
        u, s, vh = torch.linalg.svd(z, full_matrices=False)
        for r in (4, 16):
            best = (u[..., :r] * s[..., None, :r]) @ vh[..., :r, :]
            ours = LowRank(z, r, torch.float32)
            assert ours.a.shape == (LAYERS, n, r) and ours.b.shape == (LAYERS, r, D)
            assert float((ours.rows(n) - best).norm() / best.norm()) < 1e-4


def test_subspace_iteration_reaches_the_optimal_truncation() -> None:
    """Wide features (a real model's D = 1024) are factorized by subspace iteration, not a full
    eigensolve: on a decaying spectrum its rank-r error is within 0.1% of the SVD's (Eckart-Young)."""
    wide = 2 * EXACT_EIGH_MAX_FEATURES
    g = torch.Generator().manual_seed(3)
    u = torch.linalg.qr(torch.randn(2, 700, wide, generator=g))[0]
    v = torch.linalg.qr(torch.randn(2, wide, wide, generator=g))[0]
    z = (u / (1 + torch.arange(wide)) ** 0.7) @ v.mT  # singular values 1/(1+i)^0.7
    for r in (8, 32):
        optimal = float(torch.linalg.svdvals(z)[:, r:].square().sum().sqrt() / z.norm())
        by_default = LowRank(z, r, torch.float32)
        error = float((by_default.rows(700) - z).norm() / z.norm())
        assert 0.9999 * optimal < error < 1.001 * optimal  # the lower slack is fp32 rounding
        forced = LowRank(z, r, torch.float32, exact=False)  # the default path for wide features,
        assert torch.equal(forced.a, by_default.a)  # and deterministic


def test_batched_distances_equal_the_per_anchor_loop() -> None:
    """The accelerators' path (one batched GEMM per layer for all anchors) gives the CPU loop's distances."""
    anchors = [LowRank(_low_rank_plus_noise(200, 8, 0.1, seed=s), 8, torch.bfloat16) for s in range(4)]
    current = _low_rank_plus_noise(200, 8, 0.1, seed=9).bfloat16()
    loop_sums, loop_squares = anchor_distances(current, anchors, 150, gate_rows=50, path="loop")
    sums, squares = anchor_distances(current, anchors, 150, gate_rows=50, path="batched")
    assert sums.shape == (4, 150) and squares.shape == (4,)
    assert torch.allclose(sums, loop_sums, rtol=1e-2) and torch.allclose(squares, loop_squares, rtol=1e-2)


def _pool_with(contents: list[torch.Tensor], edge: str = "A0->A1", capacity: int = 10, rank: int | None = D,
               dtype: torch.dtype = torch.float32) -> AnchorPool:
    pool = AnchorPool(capacity)
    for index, base in enumerate(contents):
        delta = 0.1 * _low_rank_plus_noise(base.shape[1], 4, 0.0, seed=100 + index)
        pool.add(f"t{index}", edge, base, base, delta, delta, rank, rank, dtype)
    return pool


def test_gate_rejects_with_fewer_than_two_anchors_and_accepts_a_distinctive_match() -> None:
    contents = [_low_rank_plus_noise(64, 8, 0.1, seed=s) for s in range(3)]
    one = _pool_with(contents[:1])
    assert not reliability_gate(contents[0], one.compatible("A0->A1", 64), 64, tau=0.3).accept
    pool = _pool_with(contents)
    result = reliability_gate(contents[1], pool.compatible("A0->A1", 64), 64, tau=0.3)
    assert result.accept and int(result.weights.argmax()) == 1 and result.normalized_entropy < 0.01
    # Two equally distant anchors: maximal entropy, rejected.
    twins = _pool_with([contents[0], contents[0]])
    ambiguous = reliability_gate(contents[2], twins.compatible("A0->A1", 64), 64, tau=0.3)
    assert not ambiguous.accept and ambiguous.normalized_entropy == pytest.approx(1.0)
    # Anchors for another consumer, or shorter than the compared prefix, are not compatible.
    assert pool.compatible("A1->A2", 64) == [] and pool.compatible("A0->A1", 65) == []


def test_gate_normalizes_the_entropy_by_the_anchor_count() -> None:
    """Eq. 10-11 at an intermediate entropy with four anchors, computed here by hand: the weights
    are a softmax of minus the (root) distances and the entropy is divided by log2(4). A rule
    that compares the unnormalized entropy, or scales tau by log2(count), decides otherwise."""
    distances = torch.tensor([0.0, 0.4, 0.9, 1.5], dtype=torch.float64)
    weights = torch.exp(-distances) / torch.exp(-distances).sum()
    normalized = float(-(weights * torch.log2(weights)).sum()) / 2.0
    assert 0.4 < normalized < 0.95  # intermediate: between tau and tau * log2(4) for the taus below
    accepted = gate_from_distances(distances ** 2, tau=normalized + 0.02)
    rejected = gate_from_distances(distances ** 2, tau=normalized - 0.02)
    assert accepted.accept and not rejected.accept
    assert accepted.normalized_entropy == pytest.approx(normalized, abs=1e-6)
    assert torch.allclose(accepted.weights.double(), weights, atol=1e-6)
    assert not gate_from_distances(distances ** 2, tau=normalized / 2).accept  # tau * log2(4) would accept


def test_the_gate_compares_only_the_first_gate_tokens_rows() -> None:
    """gate_tokens = k: the gate's distances (Eq. 9) are over the first k rows. A source whose first
    4 rows are content t1's and whose other 60 are content t2's: the gate credits t1 with
    gate_tokens 4, and t2 (nearer over all 64 rows) without."""
    credited = {}
    for gate_tokens in (4, 0):
        method, _ = _three_anchors("kvcmas", {"r_c": 64, "r_delta": 64, "tau": 0.0, "gate_tokens": gate_tokens})
        method.params["tau"] = 1.0  # the anchors are in: now accept whatever the gate prefers
        _, _, t1 = _context("kvcmas", "t1", seed=1)
        ctx, reuse, mixed = _context("kvcmas", "mixed", seed=2)
        rows = slice(7, 11)  # the segment's first 4 rows in the source cache (q starts at 7 there)
        mixed.k[:, rows], mixed.v[:, rows] = t1.k[:, rows], t1.v[:, rows]
        anchors = list(method.pools["q"].anchors.values())  # t0, t1, t2 in insertion order
        before = [a.uses for a in anchors]
        (chosen,) = method.select(ctx)
        assert ctx.stats["decisions"][0]["decision"] == "accepted"
        gained = [a.uses - b for a, b in zip(anchors, before)]
        credited[gate_tokens] = gained.index(max(gained))
    assert credited == {4: 1, 0: 2}


def test_one_exact_anchor_reproduces_the_dense_cache() -> None:
    source = _low_rank_plus_noise(128, 8, 0.1, seed=0)
    dense = source + 0.2 * _low_rank_plus_noise(128, 4, 0.0, seed=50)
    # Distractors: other contents, far from this one.
    others = [5.0 + _low_rank_plus_noise(128, 8, 0.1, seed=s) for s in (1, 2)]
    pool = AnchorPool(10)
    for anchor_id, base, target in [("exact", source, dense), *[(f"o{i}", o, o + 0.3) for i, o in enumerate(others)]]:
        pool.add(anchor_id, "A0->A1", base, base, target - base, target - base, 32, 32, torch.bfloat16)
    uncorrected = float((source - dense).norm() / dense.norm())
    for anchors in (pool.compatible("A0->A1", 128), [pool.anchors["exact"]]):
        delta_k, delta_v = interpolated_delta(source, source, anchors, "A0->A1", 128)
        for delta in (delta_k, delta_v):
            relative = float((source + delta - dense).norm() / dense.norm())
            assert relative < 2 ** -8  # bf16 storage of the factors: within bf16 noise
            assert uncorrected > 20 * relative


@pytest.mark.parametrize("low_rank", [True, False])
def test_a_correction_applied_layer_by_layer_equals_the_rotated_weighted_sum(low_rank: bool) -> None:
    """`Correction.add_to` adds each layer's sum of w_v[t] * delta_v[t] into the rows in place,
    keys turned to the target positions through the B factors (low rank) or the summed rows (full):
    the same as materializing the weighted sum of the reconstructed deltas, then rotating it."""
    n, start = 96, 1234
    deltas = [_low_rank_plus_noise(n, 6, 0.0, seed=s) for s in range(3)]
    stored = [LowRank(d, 6, torch.bfloat16) if low_rank else FullRank(d, torch.bfloat16) for d in deltas]
    weights = torch.softmax(torch.randn(3, n, generator=torch.Generator().manual_seed(7)), dim=0)
    aligner = RopeAligner.from_theta(HEAD_DIM, 4096, 500000.0)

    def to_target(rows: torch.Tensor, exact: bool) -> torch.Tensor:
        return aligner.rotate(rows.reshape(len(rows), HEADS, HEAD_DIM), start, exact=exact).reshape(len(rows), -1)

    rows = torch.randn(n + 5, D).bfloat16()  # more rows than the correction covers: the rest are untouched
    for layer in range(LAYERS):
        weighted = sum(w[:, None] * d[layer] for w, d in zip(weights, deltas))  # fp32, exact factors
        expected = rows.float().clone()
        expected[:n] += to_target(weighted, True)
        out = rows.clone()
        Correction(stored, weights, n).add_to(layer, out, to_target)
        assert torch.equal(out[n:], rows[n:])
        assert float((out.float() - expected).norm() / expected.norm()) < 2 ** -7  # bf16 factors and rows
        assert float((out.float() - rows.float()).norm()) > 0.1 * float(weighted.norm())  # it did add
    one = Correction(stored[:1], None, n)  # GraphFlow: one calibrated correction, weight 1
    out = rows.clone()
    one.add_to(0, out)
    assert float((out[:n].float() - rows[:n].float() - deltas[0][0]).norm() / deltas[0][0].norm()) < 2 ** -6


def test_eviction_is_least_frequently_used_among_the_five_oldest() -> None:
    pool = _pool_with([_low_rank_plus_noise(16, 2, 0.1, seed=s) for s in range(7)], capacity=7)
    for anchor_id, uses in {"t0": 5, "t1": 3, "t2": 1, "t3": 4, "t4": 2, "t5": 0, "t6": 0}.items():
        pool.anchors[anchor_id].uses = uses
    assert pool.evict() == "t2"  # t5 and t6 have fewer uses but are not among the 5 oldest
    # Now t5 is among the five oldest (t0 t1 t3 t4 t5).
    pool.anchors["t5"].uses = 9
    pool.anchors["t4"].uses = 1
    pool.anchors["t1"].uses = 1
    assert pool.evict() == "t1"  # tie on uses: the older goes first
    # Inserting past capacity evicts automatically.
    small = _pool_with([_low_rank_plus_noise(16, 2, 0.1, seed=s) for s in range(3)], capacity=2)
    assert list(small.anchors) == ["t1", "t2"]


@pytest.mark.parametrize("capacity", [1, 2, 4])
def test_a_full_small_pool_makes_room_for_the_newcomer(capacity: int) -> None:
    """V < 5: the window of five holds every anchor and the newcomer; the newcomer (0 uses) must
    not be the one evicted, or the pool would never change once its anchors were used."""
    contents = [_low_rank_plus_noise(16, 2, 0.1, seed=s) for s in range(capacity + 2)]
    pool = _pool_with(contents[:capacity], capacity=capacity)
    for anchor in pool.anchors.values():
        anchor.uses = 3
    for index in (capacity, capacity + 1):  # two newcomers in a row
        base = contents[index]
        pool.add(f"t{index}", "A0->A1", base, base, 0.1 * base, 0.1 * base, 4, 4, torch.float32)
        assert f"t{index}" in pool.anchors and len(pool.anchors) == capacity
    assert "t0" not in pool.anchors  # the oldest of the least used made room first


@pytest.mark.parametrize("length", [2048, 8192])
def test_pool_bytes_match_the_memory_formulas(length: int) -> None:
    consumers, capacity, rank = 3, 4, 32  # each anchor: one source (A0), three consumers (fan-out)
    bases = [torch.randn(LAYERS, length, D) for _ in range(capacity)]
    low, full = AnchorPool(capacity), AnchorPool(capacity)
    for index, base in enumerate(bases):
        for consumer in range(consumers):
            for pool, r in ((low, rank), (full, None)):
                pool.add(f"t{index}", f"A0->A{consumer + 1}", base, base, base, base, r, r, torch.bfloat16)
    bf16 = 2
    # O(V (1 + N) r (L + D)) per layer for K and V, versus O(V (1 + N) L D).
    assert low.nbytes == capacity * (1 + consumers) * 2 * LAYERS * rank * (length + D) * bf16
    assert full.nbytes == capacity * (1 + consumers) * 2 * LAYERS * length * D * bf16
    assert full.nbytes / low.nbytes == pytest.approx(length * D / (rank * (length + D)))


class _Rotary(torch.nn.Module):
    rotary_dim, is_neox_style = HEAD_DIM, True

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        freqs = torch.outer(torch.arange(20000).float(), inv)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class _FakeCore:
    tensor_parallel_size = 1

    def __init__(self, shared: object = None) -> None:
        self.shared = shared  # a SharedState: this core's instance shares its anchor pools
        self.aligner = RopeAligner(_Rotary())
        self.prefills = 0
        self.prefilled: list[torch.Tensor] = []  # the tokens of each context-free prefill
        self.uncomputed: set[str] = set()  # requests vLLM has not computed since their load

    def computed(self, req_id: str) -> bool:
        return req_id not in self.uncomputed

    def shared_state(self, namespace: str) -> object:
        return self.shared

    def sum_over_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def context_free_prefill_steps(self, tokens: torch.Tensor) -> Generator[int, None, SavedKV]:
        for _ in range(LAYERS - 1):  # a pause after every layer but the last, as the partial forward
            yield len(tokens)
        self.prefills += 1
        self.prefilled.append(tokens.clone())
        g = torch.Generator().manual_seed(int(tokens.sum()))
        return SavedKV(tokens.clone(), torch.randn(LAYERS, len(tokens), HEADS, HEAD_DIM, generator=g),
                       torch.randn(LAYERS, len(tokens), HEADS, HEAD_DIM, generator=g))


def _context(method_name: str, trajectory: str, seed: int, length: int = 64, source_agent: str = "A0",
             agent: str = "A1", start: int = 10):
    """`agent`'s load: q (`length` tokens at position `start`, 10) reused from `source_agent`'s
    cache (q at position 7)."""
    g = torch.Generator().manual_seed(seed)
    source = SavedKV(torch.arange(length + 16), torch.randn(LAYERS, length + 16, HEADS, HEAD_DIM, generator=g),
                     torch.randn(LAYERS, length + 16, HEADS, HEAD_DIM, generator=g))
    segment = PlanSegment("ph", "q", start, length, source=f"run/t/{source_agent}.r0", source_start=7,
                          source_agent=source_agent)
    plan = Plan(trajectory, f"{agent}.r0", agent, f"run/{trajectory}/{agent}.r0",
                (PlanSegment("pf", "system", 0, start), segment))
    tokens = torch.cat([torch.arange(start) + 900_000, torch.arange(length + 26) + 1000 * seed])  # q's content by seed
    dst = torch.arange(start, start + length)
    reuse = SegmentReuse(segment, source, dst, dst - start + 7)
    dense = (torch.randn(LAYERS, start + length + 26, HEADS, HEAD_DIM, generator=g),
             torch.randn(LAYERS, start + length + 26, HEADS, HEAD_DIM, generator=g))
    ctx = LoadContext(plan.save_as, plan, tokens, 0, [reuse],
                      read_rows=lambda rows: (dense[0][:, rows], dense[1][:, rows]), req_id=f"{trajectory}-A1")
    return ctx, reuse, source


@pytest.mark.parametrize("name", ["kvcmas", "kvcmas-nonchained"])
def test_chaining_uses_the_source_cache_and_never_prefills_a_reference(name: str) -> None:
    method = method_class(name)({"r_c": 64, "r_delta": 64})  # full rank of a 64-token segment: exact factors
    core = _FakeCore()
    method.bind(core)
    for index in range(3):
        ctx, reuse, source = _context(name, f"t{index}", seed=index)
        chosen = method.select(ctx)
        assert chosen == []  # fewer than two anchors: dense fallback
        method.after_load(ctx)
        method.run_deferred()
    anchors = method.pools["q"].anchors
    if name == "kvcmas":
        assert core.prefills == 0  # no context-free reference is ever prefilled
        assert len(anchors) == 3 and all("A0->A1" in a.deltas for a in anchors.values())
        # The anchor's base is the source agent's cache (keys in canonical positions), not a reference.
        base_v = list(anchors.values())[2].base_v.rows(64)
        expected = source.v[:, 7:71].reshape(LAYERS, 64, D)
        assert float((base_v - expected).norm() / expected.norm()) < 2 ** -7  # bf16 factors
    else:
        assert core.prefills == 3 and all("ref->A1" in a.deltas for a in anchors.values())
    ctx, reuse, _ = _context(name, "t1", seed=1)  # content seen before: a distinctive match
    chosen = method.select(ctx)
    assert len(chosen) == 1 and ctx.stats["decisions"][0]["decision"] == "accepted"
    keys, values = method.correct(2, chosen[0], chosen[0].source.k[2, chosen[0].src], chosen[0].source.v[2, chosen[0].src])
    assert not torch.equal(values, chosen[0].source.v[2, chosen[0].src])  # a correction was applied
    method.after_load(ctx)  # the time spent applying it joins the segment's decision
    assert ctx.stats["decisions"][0]["apply_s"] > 0
    assert method.state_bytes()["anchor_pool"] > 0


@pytest.mark.parametrize("name", ["kvcmas", "kvcmas-nonchained"])
def test_a_missing_reference_is_prefilled_layer_by_layer_before_select(name: str) -> None:
    """`prepare` prefills the references a non-chained load lacks one layer at a time (so that an
    asynchronous load spreads it over engine steps); `select` then finds them. Chained KVCMAS has
    nothing to prepare."""
    method = method_class(name)({})
    core = _FakeCore()
    method.bind(core)
    ctx, _, _ = _context(name, "t0", seed=0)
    steps = list(method.prepare(ctx))
    if name == "kvcmas":
        assert steps == [] and core.prefills == 0
        return
    assert steps == [64] * (LAYERS - 1) and core.prefills == 1  # the 64-row segment q
    assert ctx.stats["reference_tokens"] == 64 and ctx.stats["reference_prefill_s"] > 0
    method.select(ctx)
    assert core.prefills == 1  # select used the prepared reference
    again, _, _ = _context(name, "t0-again", seed=0)  # the same content: nothing left to prepare
    assert list(method.prepare(again)) == [] and core.prefills == 1


@pytest.mark.parametrize("prematch", [False, True])
def test_deferred_work_waits_until_its_request_is_computed(prematch: bool) -> None:
    """Anchor construction and prematching that a load queued run only once vLLM has computed
    that load's request (with asynchronous loads, one or more steps after the load ended), and
    then in the first step that sees it; other requests' work does not wait for it."""
    method = method_class("kvcmas")({"r_c": 64, "r_delta": 64, "prematch": prematch})
    core = _FakeCore()
    method.bind(core)
    for index in range(3):
        ctx, _, source = _context("kvcmas", f"t{index}", seed=index)
        producer = _producer(source, f"t{index}")
        core.uncomputed |= {ctx.req_id, producer.req_id}
        method.select(ctx)
        method.after_load(ctx)  # a dense fallback queues its anchor
        if prematch:
            method.after_load(producer)
        for _ in range(2):  # steps in which the request is still waiting to be scheduled
            method.run_deferred()
            assert _anchors(method) == index
        core.uncomputed.discard(ctx.req_id)  # a step computed it: its first token
        method.run_deferred()
        assert _anchors(method) == index + 1
        producer_q = (producer.plan.save_as, 7, "q")
        assert producer_q not in method.memo.entries  # the producer's own turn is not computed yet
        core.uncomputed.discard(producer.req_id)
        method.run_deferred()
        # with two anchors or more, the producer's q is matched now
        assert (producer_q in method.memo.entries) == (prematch and index > 0)
    late = _context("kvcmas", "t3", seed=3)[0]
    core.uncomputed.add(late.req_id)
    method.after_load(late)
    method.reset()
    core.uncomputed.clear()
    method.run_deferred()
    assert _anchors(method) == 0  # waiting work goes with the rest of the state


def test_a_loaded_request_counts_as_computed_after_a_step_that_scheduled_it() -> None:
    from kvbench.methods.connector.compute_tracker import ComputedRequests

    tracker = ComputedRequests()
    # synchronous load: loaded in the step that computes it; computed from the next step on
    tracker.step(frozenset({"sync", "other"}))
    tracker.loaded("sync")
    assert not tracker.computed("sync")
    # asynchronous load: ends in a step that does not schedule it; the scheduler is busy for a step
    tracker.step(frozenset({"other"}))
    assert tracker.computed("sync")
    tracker.loaded("async")
    for _ in range(2):
        tracker.step(frozenset({"other"}))
        assert not tracker.computed("async")
    tracker.step(frozenset({"async"}))  # scheduled now: computed once this step has run
    assert not tracker.computed("async")
    tracker.step(frozenset())
    assert tracker.computed("async")
    # an aborted request never computed: its work is released rather than kept forever
    tracker.loaded("aborted")
    tracker.step(frozenset())
    tracker.finished({"aborted"})
    assert tracker.computed("aborted") and tracker.computed("never-loaded")


def _anchors(method) -> int:
    return len(method.pools["q"].anchors) if "q" in method.pools else 0


def test_method_parameters_are_validated() -> None:
    from kvbench.methods.api.base import MethodConfigError

    with pytest.raises(MethodConfigError, match=r"kvcmas: tau: Input should be less than or equal to 1 \(got 2\)"):
        method_class("kvcmas")({"tau": 2})
    with pytest.raises(MethodConfigError, match=r"r_c: Input should be greater than or equal to 1 \(got 0\)"):
        method_class("kvcmas")({"r_c": 0})
    with pytest.raises(MethodConfigError, match=r"method 'graphflow' has no parameter\(s\) V; known: rho, store_codec"):
        method_class("graphflow")({"V": 3})
    with pytest.raises(MethodConfigError, match="recompute_ratio: Input should be less than or equal to 1"):
        method_class("cacheblend")({"recompute_ratio": 1.5})
    with pytest.raises(MethodConfigError, match="check_layer: Input should be greater than or equal to 0"):
        method_class("cacheblend")({"check_layer": -1})
    with pytest.raises(MethodConfigError, match="deviation: Input should be 'value' or 'key'"):
        method_class("cacheblend")({"deviation": "norm"})
    assert method_class("kvcomm")({}).params == {"V": 20, "gamma": 0.3, "gate_tokens": 0, "base_codec": "none",
                                                 "gate": "entropy", "apply_corrections": True, "store_codec": "none"}
    assert math.isclose(method_class("kvcmas")({"tau": 0.5}).threshold(), 0.5)


@pytest.mark.parametrize("name", ["kvcmas", "kvcmas-nonchained"])
def test_references_and_anchors_are_keyed_by_content_not_trajectory_id(name: str) -> None:
    """Trajectory ids repeat across runs on one server (t000000...): state must follow content."""
    method = method_class(name)({"r_c": 64, "r_delta": 64})
    core = _FakeCore()
    method.bind(core)
    for seed in (0, 5):  # same trajectory id, other tokens
        ctx, _, _ = _context(name, "t0", seed=seed)
        method.select(ctx)
        method.after_load(ctx)
        method.run_deferred()
    assert len(method.pools["q"].anchors) == 2  # two contents, two anchors
    assert core.prefills == (0 if name == "kvcmas" else 2)  # no stale reference served for new content


def _primed(name: str, **params):
    """A method whose q pool holds three anchors (three dense fallbacks of distinct contents)."""
    method = method_class(name)({"r_c": 64, "r_delta": 64, **params})
    method.bind(_FakeCore())
    for index in range(3):
        ctx, _, _ = _context(name, f"t{index}", seed=index)
        method.select(ctx)
        method.after_load(ctx)
        method.run_deferred()
    return method


def _producer(source: SavedKV, trajectory: str) -> LoadContext:
    """A0's own load, whose cache (q at position 7) is what A1 reads: saved as run/t/A0.r0."""
    plan = Plan(trajectory, "A0.r0", "A0", "run/t/A0.r0",
                (PlanSegment("pf", "system", 0, 7), PlanSegment("ph", "q", 7, 64)))
    return LoadContext(plan.save_as, plan, source.token_ids, 0, [],
                       read_rows=lambda rows: (source.k[:, rows], source.v[:, rows]), req_id=f"{trajectory}-A0")


def _corrected(method, ctx: LoadContext) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    chosen = method.select(ctx)
    assert len(chosen) == 1
    reuse = chosen[0]
    keys, values = method.correct(2, reuse, reuse.source.k[2, reuse.src].clone(), reuse.source.v[2, reuse.src].clone())
    return ctx.stats["decisions"], keys, values


def test_prematched_distances_give_the_same_decision_without_recomputing_the_source() -> None:
    import copy

    method = _primed("kvcmas", prematch=True)
    at_load = copy.deepcopy(method)
    at_load.params["prematch"] = False
    ctx, _, source = _context("kvcmas", "t1", seed=1)  # content seen before: accepted
    method.after_load(_producer(source, "t1"))  # the producer's load: its q is queued...
    method.run_deferred()  # ...and matched after its first token
    assert method.memo.nbytes > 0 and method.state_bytes()["match_memo"] == method.memo.nbytes
    decisions, keys, values = _corrected(method, ctx)
    expected, expected_keys, expected_values = _corrected(at_load, _context("kvcmas", "t1", seed=1)[0])
    assert decisions[0]["decision"] == expected[0]["decision"] == "accepted"
    assert decisions[0]["memo_anchors"] == decisions[0]["anchors"] == 3 and expected[0]["memo_anchors"] == 0
    assert decisions[0]["rows_s"] == 0.0 < expected[0]["rows_s"]  # the source rows were never rebuilt
    assert decisions[0]["entropy"] == pytest.approx(expected[0]["entropy"], abs=1e-12)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


def test_prematched_distances_of_another_cache_are_not_used() -> None:
    method = _primed("kvcmas", prematch=True)
    ctx, _, source = _context("kvcmas", "t1", seed=1)
    stale = SavedKV(source.token_ids, source.k.clone(), source.v.clone() + 1.0)  # what was saved is not this
    method.after_load(_producer(stale, "t1"))
    method.run_deferred()
    decisions, _, _ = _corrected(method, ctx)
    assert decisions[0]["decision"] == "accepted" and decisions[0]["memo_anchors"] == 0
    assert ("run/t/A0.r0", 7, "q") not in method.memo.entries  # dropped, not trusted again


def test_a_reference_is_matched_once_for_every_agent_reading_it() -> None:
    method = _primed("kvcmas-nonchained")
    first, keys, values = _corrected(method, _context("kvcmas-nonchained", "t1", seed=1)[0])
    again, keys_again, values_again = _corrected(method, _context("kvcmas-nonchained", "t1", seed=1)[0])
    assert first[0]["decision"] == again[0]["decision"] == "accepted"
    assert again[0]["memo_anchors"] == again[0]["anchors"] == 3 and again[0]["rows_s"] == 0.0
    assert torch.equal(keys, keys_again) and torch.equal(values, values_again)


def test_prematch_is_validated() -> None:
    from kvbench.methods.api.base import MethodConfigError

    with pytest.raises(MethodConfigError, match=r"prematch: Input should be a valid boolean \(got 'yes'\)"):
        method_class("kvcmas")({"prematch": "yes"})
    with pytest.raises(MethodConfigError, match="chained sources only"):
        method_class("kvcmas-nonchained")({"prematch": True})


def test_a_failed_prematch_leaves_the_matching_to_the_load(caplog: pytest.LogCaptureFixture) -> None:
    method = _primed("kvcmas", prematch=True)
    ctx, _, source = _context("kvcmas", "t1", seed=1)
    producer = _producer(source, "t1")

    def unreadable(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("blocks gone")

    producer.read_rows = unreadable
    method.after_load(producer)
    method.run_deferred()  # logged, not raised: deferred work never takes the engine down
    assert "prematch of" in caplog.text and ("run/t/A0.r0", 7, "q") not in method.memo.entries
    decisions, _, _ = _corrected(method, ctx)
    assert decisions[0]["decision"] == "accepted" and decisions[0]["memo_anchors"] == 0


def _three_anchors(name: str, params: dict) -> tuple:
    """A method whose slot-q pool holds the anchors of three contents (seeds 0-2), each built from
    a dense fallback after its request was computed."""
    method = method_class(name)({**params})
    core = _FakeCore()
    method.bind(core)
    for index in range(3):
        ctx, _, _ = _context(name, f"t{index}", seed=index)
        assert method.select(ctx) == []
        method.after_load(ctx)
        method.run_deferred()
    return method, core


def test_an_ambiguous_match_goes_dense_and_becomes_an_anchor() -> None:
    method, _ = _three_anchors("kvcmas", {"r_c": 64, "r_delta": 64, "tau": 0.0})  # accept only a certain match
    before = len(method.pools["q"].anchors)
    ctx, _, _ = _context("kvcmas", "t1-again", seed=1)  # seen content: entropy near 0, but not 0
    assert method.select(ctx) == []  # rejected: the segment is computed
    (decision,) = ctx.stats["decisions"]
    assert decision["decision"] == "dense_gate" and 0 < decision["entropy"] < 0.3 and decision["anchors"] == 3
    method.after_load(ctx)
    method.run_deferred()
    assert len(method.pools["q"].anchors) == before + 1  # the dense rows became an anchor


def test_kvcomm_leaves_layer_zero_uncorrected() -> None:
    method, core = _three_anchors("kvcomm", {})
    assert core.prefills == 3  # context-free references, one per content
    ctx, _, _ = _context("kvcomm", "t1-again", seed=1)
    (chosen,) = method.select(ctx)
    assert ctx.stats["decisions"][0]["decision"] == "accepted"
    for layer, corrected in ((0, False), (1, True)):
        k, v = chosen.source.k[layer, chosen.src].clone(), chosen.source.v[layer, chosen.src].clone()
        new_k, new_v = method.correct(layer, chosen, k.clone(), v.clone())
        assert (not torch.equal(new_v, v)) == corrected and (not torch.equal(new_k, k)) == corrected, layer


def test_graphflow_calibrates_once_then_applies_without_matching() -> None:
    method = method_class("graphflow")({})
    method.bind(_FakeCore())
    first, _, _ = _context("graphflow", "t0", seed=0)
    assert method.select(first) == [] and first.stats["decisions"][0]["decision"] == "calibrate"
    method.after_load(first)
    method.run_deferred()
    for index in (5, 6):  # contents never seen: applied anyway, from the one calibration
        ctx, _, _ = _context("graphflow", f"t{index}", seed=index)
        (chosen,) = method.select(ctx)
        decision = ctx.stats["decisions"][0]
        assert decision["decision"] == "accepted" and decision["anchors"] == 1 and "entropy" not in decision
        method.after_load(ctx)
    assert list(method.calibrations) == [("q", "ref->A1")] and not method.pools


def _dense_loads(method, loads: list[dict]) -> None:
    """Loads that all fall back (the pool cannot match yet), each turned into an anchor."""
    for load in loads:
        ctx, _, _ = _context(method.name, **load)
        assert method.select(ctx) == []
        method.after_load(ctx)
        method.run_deferred()


def test_an_anchor_pairs_its_base_with_corrections_from_the_same_source() -> None:
    """Eq. 7: a fallback on A1->A2 over content first seen on A0->A1 is a new anchor with A1's
    cache as its base, not a correction against A0's base added to the old anchor."""
    method = method_class("kvcmas")({"r_c": 64, "r_delta": 64})
    method.bind(_FakeCore())
    _dense_loads(method, [dict(trajectory="t0", seed=0, source_agent="A0", agent="A1"),
                          dict(trajectory="t0", seed=0, source_agent="A1", agent="A2"),
                          dict(trajectory="t0", seed=0, source_agent="A0", agent="A3")])  # fan-out from A0
    anchors = list(method.pools["q"].anchors.values())
    assert sorted((a.source, sorted(a.deltas)) for a in anchors) == [("A0", ["A0->A1", "A0->A3"]), ("A1", ["A1->A2"])]
    # Each base is its own source's rows: A1's context (seed 0, source_agent A1) is another cache.
    _, _, a1_source = _context("kvcmas", "t0", seed=0, source_agent="A1", agent="A2")
    a1 = next(a for a in anchors if a.source == "A1")
    expected = a1_source.v[:, 7:71].reshape(LAYERS, 64, D)
    assert float((a1.base_v.rows(64) - expected).norm() / expected.norm()) < 2 ** -7
    pool = AnchorPool(4)
    base = torch.randn(LAYERS, 16, D)
    pool.add("t0/A0/c", "A0->A1", base, base, base, base, None, None, torch.bfloat16)
    with pytest.raises(ValueError, match="holds A0's cache as its base; a correction observed on edge A1->A2"):
        pool.add("t0/A0/c", "A1->A2", base, base, base, base, None, None, torch.bfloat16)


def test_a_pool_of_one_anchor_bypasses_the_gate_and_reuses() -> None:
    """V = 1 (the paper's Table 13, first row): the sole compatible anchor is applied with weight 1."""
    method = method_class("kvcmas")({"V": 1, "r_c": 64, "r_delta": 64})
    method.bind(_FakeCore())
    _dense_loads(method, [dict(trajectory="t0", seed=0)])
    ctx, _, _ = _context("kvcmas", "t1", seed=1)  # new content: no gate to pass, the one anchor is used
    (chosen,) = method.select(ctx)
    assert ctx.stats["decisions"][0]["decision"] == "accepted" and ctx.stats["decisions"][0]["anchors"] == 1
    keys, values = method.correct(2, chosen, chosen.source.k[2, chosen.src].clone(), chosen.source.v[2, chosen.src].clone())
    assert not torch.equal(values, chosen.source.v[2, chosen.src])
    two = method_class("kvcmas")({"V": 2, "r_c": 64, "r_delta": 64})  # V > 1 with one anchor: the gate cannot run
    two.bind(_FakeCore())
    _dense_loads(two, [dict(trajectory="t0", seed=0), dict(trajectory="t1", seed=1)])
    assert len(two.pools["q"].anchors) == 2


@pytest.mark.parametrize("segment, lengths, covered, anchors", [
    (40, (32, 48, 64), 40, 2),   # shorter than two anchors: all of it, by the anchors covering it
    (64, (32, 48, 64), 48, 2),   # longer than all but one: the prefix the second-longest covers
    (96, (32, 48, 64), 48, 2),   # longer than every anchor: the same prefix
    (96, (32, 32, 48), 32, 3),   # ties: every anchor covering that prefix
    (24, (32, 48, 64), 24, 3),
])
def test_a_segment_longer_than_its_anchors_is_corrected_on_the_covered_prefix(
        segment: int, lengths: tuple[int, ...], covered: int, anchors: int) -> None:
    """The paper's coverage rule: the longest prefix the gate can compare (covered by two anchors)
    is corrected by the anchors covering it; rows past it keep the re-aligned source cache."""
    method = method_class("kvcmas")({"r_c": 64, "r_delta": 64, "tau": 0.0})  # every load an anchor...
    method.bind(_FakeCore())
    _dense_loads(method, [dict(trajectory=f"t{i}", seed=i, length=n) for i, n in enumerate(lengths)])
    method.params["tau"] = 1.0  # ...then the gate accepts any match
    ctx, _, _ = _context("kvcmas", "new", seed=9, length=segment)
    (chosen,) = method.select(ctx)
    decision = ctx.stats["decisions"][0]
    assert (decision["decision"], decision["covered"], decision["anchors"]) == ("accepted", covered, anchors)
    k, v = chosen.source.k[2, chosen.src].clone(), chosen.source.v[2, chosen.src].clone()
    new_k, new_v = method.correct(2, chosen, k.clone(), v.clone())
    assert not torch.equal(new_v[:covered], v[:covered]) and torch.equal(new_v[covered:], v[covered:])
    assert torch.equal(new_k[covered:], k[covered:])


@pytest.mark.parametrize("name", ["kvcomm", "kvcomm-ref"])
def test_kvcomm_corrects_only_placeholders_two_anchors_cover_whole(name: str) -> None:
    """KVComm's code matches only anchors at least as long as the placeholder; with fewer than two
    of them the segment goes dense (KVCMAS would correct the prefix two anchors cover)."""
    decisions = {}
    for segment in (40, 64):
        method = method_class(name)({"gamma": 0.0})  # every load an anchor...
        method.bind(_FakeCore())
        _dense_loads(method, [dict(trajectory=f"t{i}", seed=i, length=n) for i, n in enumerate((32, 48, 64))])
        method.params["gamma"] = 1.0  # ...then the gate accepts any match
        ctx, _, _ = _context(name, "new", seed=9, length=segment)
        method.select(ctx)
        decisions[segment] = ctx.stats["decisions"][0]
    assert decisions[40]["decision"] == "accepted" and decisions[40]["covered"] == 40  # 48 and 64 cover it
    assert decisions[64]["decision"] == "dense_uncovered"  # only one anchor is 64 long


def test_kvcomm_ref_adds_key_corrections_where_its_anchor_saw_them() -> None:
    """KVComm's code keeps a delta post-RoPE at its anchor's positions and adds it elsewhere
    unrotated; kvcomm (and KVCMAS) keep it canonical and rotate it to the target. An anchor seen
    at position 10, applied at position 30 (V = 1: the sole anchor, weight 1)."""
    added = {}
    for name in ("kvcomm", "kvcomm-ref"):
        method = method_class(name)({"V": 1})
        core = _FakeCore()
        method.bind(core)
        _dense_loads(method, [dict(trajectory="t0", seed=0, start=10)])
        ctx, _, _ = _context(name, "t0-again", seed=0, start=30)
        (chosen,) = method.select(ctx)
        (anchor,) = method.pools["q"].anchors.values()
        stored = anchor.deltas[next(iter(anchor.deltas))][0].rows(64, 2).float()  # [64, H * hd]
        k = chosen.source.k[2, chosen.src].clone()
        new_k, _ = method.correct(2, chosen, k.clone(), chosen.source.v[2, chosen.src].clone())
        added[name] = ((new_k - k).reshape(64, -1).float(), stored, core)
    delta, stored, core = added["kvcomm-ref"]
    assert torch.allclose(delta, stored, atol=2e-2)  # as stored: the anchor's positions (10)
    delta, stored, core = added["kvcomm"]
    rotated = core.aligner.rotate(stored.view(64, HEADS, HEAD_DIM), 30).reshape(64, -1)
    assert torch.allclose(delta, rotated, atol=2e-2) and not torch.allclose(delta, stored, atol=2e-2)


@pytest.mark.parametrize("rho", [0.5, 0.8, 1.0])
def test_graphflow_reaches_a_requested_reuse_ratio_on_a_trace(rho: float) -> None:
    """Its reuse budget: over a trace of segments of varying length read by three agents, the
    realized rho (reused over eligible shared tokens) lands within 0.05 of the target."""
    method = method_class("graphflow")({"rho": rho})
    method.bind(_FakeCore())
    lengths = torch.randint(16, 96, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    eligible = reused = 0
    for index, length in enumerate(lengths):
        ctx, _, _ = _context("graphflow", f"t{index // 3}", seed=index // 3, length=length, agent=f"A{index % 3 + 1}")
        chosen = method.select(ctx)
        method.after_load(ctx)
        method.run_deferred()
        eligible += ctx.stats["eligible_tokens"]
        reused += sum(len(c.dst) for c in chosen)
    assert eligible == sum(lengths)
    calibration = sum(lengths[:3])  # each agent's first segment calibrates its relation, densely
    assert abs(reused / eligible - rho) <= 0.05 or (rho == 1.0 and reused == eligible - calibration)


def test_graphflow_stores_only_the_corrections_it_applies() -> None:
    method = method_class("graphflow")({})
    method.bind(_FakeCore())
    for agent in ("A1", "A2"):
        _dense_loads(method, [dict(trajectory="t0", seed=0, agent=agent)])
    bf16 = 2
    # Per relation: dK and dV, [layers, 64, D] each; no base cache.
    assert method.state_bytes()["anchor_pool"] == 2 * 2 * LAYERS * 64 * D * bf16
    assert set(method.calibrations) == {("q", "ref->A1"), ("q", "ref->A2")}


BOS = 7


def _two_segment_context(trajectory: str, q_seed: int, out_seed: int) -> LoadContext:
    """A1's load of [BOS, system (9 rows), q (64 rows), out:A0.r0 (16 rows)]: q's content set by
    q_seed; A0's output (rows 71-86 of A0's cache) by out_seed."""
    g = torch.Generator().manual_seed(out_seed)
    producer = SavedKV(torch.arange(90), torch.randn(LAYERS, 90, HEADS, HEAD_DIM, generator=g),
                       torch.randn(LAYERS, 90, HEADS, HEAD_DIM, generator=g))
    q = PlanSegment("ph", "q", 10, 64)
    out = PlanSegment("ph", "out:A0.r0", 74, 16, source="run/t/A0.r0", source_start=71, source_turn="A0.r0",
                      source_agent="A0")
    plan = Plan(trajectory, "A1.r0", "A1", f"run/{trajectory}/A1.r0", (PlanSegment("pf", "system", 1, 9), q, out))
    tokens = torch.cat((torch.tensor([BOS]), 100 + torch.arange(9), 1000 * (q_seed + 1) + torch.arange(64),
                        5000 * (out_seed + 1) + torch.arange(16)))
    dst = torch.arange(74, 90)
    dense = (torch.randn(LAYERS, 90, HEADS, HEAD_DIM, generator=g), torch.randn(LAYERS, 90, HEADS, HEAD_DIM, generator=g))
    return LoadContext(plan.save_as, plan, tokens, 0, [SegmentReuse(out, producer, dst, dst - 74 + 71)],
                       read_rows=lambda rows: (dense[0][:, rows], dense[1][:, rows]), req_id=f"{trajectory}-A1")


def test_kvcomm_ref_prefills_references_after_bos_and_corrects_outputs_from_their_producer() -> None:
    """kvcomm-ref (KVComm's code): q's reference is [BOS, q] (q's first token is no attention sink),
    and A0's output is corrected from A0's own cache (edge A0->A1), never prefilled alone. kvcomm
    (the KVCMAS paper's description) prefills both segments alone."""
    for name, prefilled, out_edge in (("kvcomm-ref", [[BOS, *range(1000, 1064)]], "A0->A1"),
                                      ("kvcomm", [list(range(1000, 1064)), list(range(5000, 5016))], "ref->A1")):
        method = method_class(name)({})
        core = _FakeCore()
        method.bind(core)
        ctx = _two_segment_context("t0", q_seed=0, out_seed=0)
        list(method.prepare(ctx))
        assert method.select(ctx) == []  # no anchors yet: both dense
        assert [t.tolist() for t in core.prefilled] == prefilled, name
        method.after_load(ctx)
        method.run_deferred()
        assert list(method.pools["out:A0.r0"].anchors.values())[0].deltas.keys() == {out_edge}
        if name == "kvcomm-ref":
            (anchor,) = method.pools["out:A0.r0"].anchors.values()
            producer_rows = ctx.candidates[0].source.v[:, 71:87].reshape(LAYERS, 16, D)
            assert anchor.source == "A0" and torch.equal(anchor.base_v.rows(16), producer_rows.bfloat16().float())
            (q_anchor,) = method.pools["q"].anchors.values()  # the base: the reference's q rows, after BOS
            reference = method.references.entries[next(iter(method.references.entries))]
            assert len(reference.token_ids) == 65
            assert torch.equal(q_anchor.base_v.rows(64), reference.v[:, 1:].reshape(LAYERS, 64, D).bfloat16().float())


@pytest.mark.parametrize("name, chosen", [("kvcomm-ref", 0), ("kvcomm", 1)])
def test_kvcomm_ref_sends_the_whole_agent_dense_when_one_segment_is_rejected(name: str, chosen: int) -> None:
    method = method_class(name)({})
    method.bind(_FakeCore())
    for seed in range(3):  # three contents of q and of A0's output, each an anchor
        ctx = _two_segment_context(f"t{seed}", q_seed=seed, out_seed=seed)
        list(method.prepare(ctx))
        assert method.select(ctx) == []
        method.after_load(ctx)
        method.run_deferred()
    ctx = _two_segment_context("t9", q_seed=1, out_seed=9)  # q seen before, A0's output new
    list(method.prepare(ctx))
    assert len(method.select(ctx)) == chosen
    decisions = {d["id"]: d["decision"] for d in ctx.stats["decisions"]}
    assert decisions["out:A0.r0"] == "dense_gate"
    assert decisions["q"] == ("dense_agent" if name == "kvcomm-ref" else "accepted")
    method.after_load(ctx)
    method.run_deferred()
    assert len(method.pools["q"].anchors) == 3  # an accepted segment sent dense is not an anchor


def test_graphflow_starts_its_budget_afresh_when_a_measured_run_follows_warm_ups() -> None:
    """After priming (warm-ups that calibrate densely), the measured run's rho is the target's,
    not above it to make up for the calibrations."""
    method = method_class("graphflow")({"rho": 0.5})
    method.bind(_FakeCore())
    for index in range(3):  # warm-ups: one calibration, then the budget
        ctx, _, _ = _context("graphflow", f"w{index}", seed=index)
        method.select(ctx)
        method.after_load(ctx)
        method.run_deferred()
    method.restart_peaks()  # what a primed run does before its measured trajectories
    assert (method.budget.eligible, method.budget.reused) == (0, 0) and method.calibrations
    reused = sum(len(method.select(_context("graphflow", f"m{i}", seed=10 + i)[0])) for i in range(4))
    assert reused == 2  # half of four equal segments


def test_coded_bases_are_compressed_and_still_match() -> None:
    """KVComm's `base_codec`: full-size bases kept by PolyKV's codec take >= 2.5x fewer bytes than
    bf16 and still single out the right anchor; corrections are kept as they are."""
    from kvbench.methods.core.kv_codec import make_codec
    from kvbench.methods.delta.stored import BaseCodec, Coded

    contents = [_low_rank_plus_noise(64, 8, 0.1, seed=s) for s in range(3)]
    plain, coded = AnchorPool(10), AnchorPool(10)
    for index, base in enumerate(contents):
        delta = 0.1 * _low_rank_plus_noise(64, 4, 0.0, seed=100 + index)
        plain.add(f"t{index}", "A0->A1", base, base, delta, delta, None, None, torch.bfloat16)
        coded.add(f"t{index}", "A0->A1", base, base, delta, delta, None, None, torch.bfloat16,
                  BaseCodec(make_codec("polykv"), HEAD_DIM))
    anchor = coded.anchors["t1"]
    assert isinstance(anchor.base_k, Coded) and isinstance(anchor.base_v, Coded)
    bases = sum(a.base_k.nbytes + a.base_v.nbytes for a in plain.anchors.values())
    coded_bases = sum(a.base_k.nbytes + a.base_v.nbytes for a in coded.anchors.values())
    assert bases / coded_bases >= 2.5
    assert coded.nbytes - coded_bases == plain.nbytes - bases  # the corrections are untouched
    for stored, original in ((anchor.base_k, contents[1]), (anchor.base_v, contents[1])):
        assert stored.shape == tuple(original.shape)
        assert float((stored.rows(64) - original).norm() / original.norm()) < 0.2
        assert torch.equal(stored.rows(64)[2], stored.rows(64, layer=2))
    result = reliability_gate(contents[1], coded.compatible("A0->A1", 64), 64, tau=0.3)
    assert result.accept and int(result.weights.argmax()) == 1
    with pytest.raises(Exception, match="unknown KV codec 'lz4'"):
        method_class("kvcomm")({"base_codec": "lz4"})
