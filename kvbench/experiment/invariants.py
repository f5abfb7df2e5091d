"""What `kvbench check` asserts: each method, at a setting where it must equal a known computation,
against that computation, and the comparisons that decide pass or fail (no server here: the
driver, kvbench.experiment.method_check, feeds them what the servers returned).

Every invariant holds exactly in arithmetic; what a check allows on top is named with it: a greedy
decode may leave the reference only at a near-tie (the reference's two candidates closer in
log-probability than kvbench's own forward differs from vLLM's, measured on the same prompt), K/V
may differ from a dense prefill by at most twice that same forward's own difference, layer by
layer, and placed rows may differ from the reference's by one rounding of the cache's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

CHECK_VERSION = 1  # the layout of check.json
Reference = Literal["dense", "fullshared", "base-model"]
Workload = Literal["reuse", "self-read", "identity-adapters"]
Status = Literal["pass", "fail", "skipped"]

# Relative size of one rounding step of each cache dtype (half the spacing at 1.0).
DTYPE_EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}


@dataclass(frozen=True)
class ModelFacts:
    """What an invariant's settings depend on, read from the model's config."""

    num_layers: int
    dtype: str  # the cache's: bfloat16, float16 or float32


@dataclass(frozen=True)
class Invariant:
    name: str
    method: str
    claim: str  # what must hold, in words (the table's and the docs' text)
    params: Callable[[ModelFacts], dict[str, Any]]  # the method's parameters for it (SET_PARAMS)
    reference: Reference
    workload: Workload = "reuse"
    compare_rows: bool = False  # placed K/V rows against the reference's (not outputs against dense)
    only_accepted: bool = False  # only turns whose every reused segment the method accepted


INVARIANTS: tuple[Invariant, ...] = (
    Invariant("self-read", "fullshared", "an agent reading its own earlier cache gives NonShared's outputs",
              lambda facts: {}, "dense", workload="self-read"),
    Invariant("rope-realignment", "fullshared", "placed layer-0 keys equal a dense prefill's at their new positions",
              lambda facts: {}, "dense", compare_rows=True),
    Invariant("gate-dense", "kvcmas", "every segment sent dense by the gate gives NonShared's outputs",
              lambda facts: {"gate": "dense"}, "dense"),
    Invariant("zero-deltas", "kvcmas", "accepted matches with no correction added place FullShared's K/V",
              lambda facts: {"gate": "accept", "apply_corrections": False}, "fullshared", compare_rows=True,
              only_accepted=True),
    Invariant("gate-dense", "kvcomm", "every segment sent dense by the gate gives NonShared's outputs",
              lambda facts: {"gate": "dense"}, "dense"),
    Invariant("gate-dense", "kvcomm-ref", "every segment sent dense by the gate gives NonShared's outputs",
              lambda facts: {"gate": "dense"}, "dense"),
    Invariant("gate-dense", "kvcmas-nonchained", "every segment sent dense by the gate gives NonShared's outputs",
              lambda facts: {"gate": "dense"}, "dense"),
    Invariant("no-budget", "graphflow", "a reuse budget of 0 (rho 0) sends every segment dense: NonShared's outputs",
              lambda facts: {"rho": 0.0}, "dense"),
    Invariant("rectify-all", "relaycaching", "every reused row rectified in every layer gives NonShared's outputs",
              lambda facts: {"tau_dev": 0.0, "tau_inf": 0.0, "start_layer": 0, "end_layer": -1}, "dense"),
    Invariant("recompute-all", "cacheblend", "recompute ratio 1 gives NonShared's outputs",
              lambda facts: {"recompute_ratio": 1.0}, "dense"),
    Invariant("all-layers", "droidspeak", "every layer recomputed gives NonShared's outputs",
              lambda facts: {"layers": [0, facts.num_layers]}, "dense"),
    Invariant("identity-codec", "polykv", "the identity codec places FullShared's K/V",
              lambda facts: {"store_codec": "identity"}, "fullshared", compare_rows=True),
    Invariant("identity-adapters", "precache-prelr", "identity adapters give the base model's outputs",
              lambda facts: {}, "base-model", workload="identity-adapters"),
    Invariant("identity-adapters", "precache-rebase", "identity adapters give the base model's outputs",
              lambda facts: {}, "base-model", workload="identity-adapters"),
)


def invariants_of(methods: Sequence[str]) -> list[Invariant]:
    """The invariants of `methods`, in the table's order; a method with none is an error naming
    those that have some."""
    known = sorted({i.method for i in INVARIANTS})
    if unknown := [m for m in methods if m not in known]:
        raise ValueError(f"kvbench check has no invariant for {', '.join(unknown)}; methods it checks: {', '.join(known)}")
    return [i for i in INVARIANTS if i.method in methods]


@dataclass
class Outcome:
    """One invariant's verdict, with the evidence that decided it."""

    method: str
    invariant: str
    claim: str
    status: Status
    evidence: str  # one line: the first mismatching token or the largest K/V difference
    turns: int = 0  # turns compared
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------ comparisons
@dataclass(frozen=True)
class Divergence:
    step: int
    got: int
    expected: int
    margin: float  # reference log-prob of its token minus that of the one generated (inf: not in its top)
    near_tie: bool


def first_divergence(got: Sequence[int], expected: Sequence[int], expected_top: Sequence[dict[int, float]],
                     tolerance: float) -> Divergence | None:
    """Where a greedy decode first leaves the reference's tokens (None: never, over the shorter of
    the two). A near-tie is a step where the reference ranked the generated token within
    `tolerance` of its own: both decodes are then right, and nothing after it is comparable."""
    for step, (a, b) in enumerate(zip(got, expected)):
        if a == b:
            continue
        top = expected_top[step] if step < len(expected_top) else {}
        margin = top[b] - top[a] if a in top and b in top else math.inf
        return Divergence(step, a, b, margin, margin <= tolerance)
    return None


def worst_layer_excess(errors: Sequence[dict[str, float]], noise: Sequence[dict[str, float]], factor: float = 2.0,
                       floor: float = 1e-4) -> tuple[float, str]:
    """The largest ratio of a layer's K or V error (relative to a dense prefill) to what is allowed
    there (`factor` x the same layer's error of kvbench's own forward of every row, at least
    `floor`), and which layer and half it is, e.g. (0.6, "layer 5 v: 0.0031 (allowed 0.0052)")."""
    worst, where = 0.0, "no layer"
    for layer, (error, own) in enumerate(zip(errors, noise)):
        for half in ("k", "v"):
            allowed = max(factor * own[f"{half}_rel"], floor)
            ratio = error[f"{half}_rel"] / allowed
            if ratio > worst or where == "no layer":
                worst, where = ratio, f"layer {layer} {half}: {error[f'{half}_rel']:.3g} (allowed {allowed:.3g})"
    return worst, where


def rows_difference(got: Sequence[Any], expected: Sequence[Any]) -> tuple[float, float]:
    """(largest |got - expected|, largest |expected|) over two nested lists of rows."""
    import torch

    a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    if a.shape != b.shape:
        return math.inf, float(b.abs().max()) if b.numel() else 0.0
    return (float((a - b).abs().max()) if a.numel() else 0.0), (float(b.abs().max()) if b.numel() else 0.0)


def rope_ulps(got: Sequence[Any], expected: Sequence[Any], dtype: str) -> float:
    """Largest difference of two key rows [n, heads, head_dim] in rounding steps of `dtype` at the
    magnitude of each rotated pair (x_i, x_{i + d/2}): RoPE turns a pair as a 2-vector, so its
    rounding error scales with the pair's norm, not with one element that lands near zero."""
    import torch

    a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    if a.shape != b.shape or not a.numel():
        return math.inf if a.shape != b.shape else 0.0
    x1, x2 = b.chunk(2, dim=-1)
    pair_norm = torch.sqrt(x1 * x1 + x2 * x2)
    pair = torch.cat((pair_norm, pair_norm), dim=-1)
    bits = -round(math.log2(DTYPE_EPS.get(dtype, 2.0 ** -8))) - 1  # stored mantissa bits
    spacing = torch.exp2(torch.floor(torch.log2(pair.clamp_min(2.0 ** -10))) - bits)
    return float(((a - b).abs() / spacing).max())
