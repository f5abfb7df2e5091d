"""The KVCMAS paper's cache-fidelity analyses (Figs 2, 3, 7 and Table 2), from what
`kvbench.experiment.fidelity` measured inside the vLLM workers on a trace's real shared segments:

- fig2: effective rank (the fewest singular values holding `ENERGY` of the squared singular-value
  sum) of the base cache (the source agent's rows, re-aligned) and of the cross-agent correction
  (target - base), per layer, keys and values;
- fig3: KV error against dense prefill, ||C - C_dense||_F / ||C_dense||_F over the shared
  segments, (a) per layer and (b) per agent in execution order, for each method measured;
- table2: the share of reuse error energy that recomputing a budget of (token, layer) entries
  removes, when the entries are chosen by layer (DroidSpeak: the layers that deviated most on the
  other trajectories), by value deviation at the check layer (CacheBlend) or by attention from the
  prompt's tail (RelayCaching), and that share over random selection's (its expectation: the
  budget's share of entries);
- fig7: fig2's correction ranks split by what precedes the segment: PF only (the query, after the
  role's system prompt: a relation that recurs across requests) or PH too (agents' outputs, after
  the query and earlier outputs, which change with every request); and the relative error left
  by a rank-r truncation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kvbench import run_files

ENERGY = 0.9  # the paper's: the minimum rank retaining 90% of the singular-value energy
PAPER_RANK = 32  # KVCMAS's r, the dotted line of the paper's Fig 2
TRUNCATION_RANKS = (1, 2, 4, 8, 16, 32, 64)
SEGMENTS_FILE = run_files.FIDELITY_SEGMENTS
ERRORS_FILE = run_files.FIDELITY_ERRORS


def effective_rank(singular_values: Sequence[float], energy: float = ENERGY) -> int:
    """The fewest leading singular values whose squares hold `energy` of their total (0 for a zero matrix)."""
    squares = np.square(np.sort(np.asarray(singular_values, dtype=np.float64))[::-1])
    total = squares.sum()
    if total <= 0:
        return 0
    return int(np.searchsorted(np.cumsum(squares) / total, energy - 1e-12) + 1)


def truncation_error(singular_values: Sequence[float], rank: int) -> float:
    """||X - X_r||_F / ||X||_F of the best rank-`rank` approximation (Eckart-Young)."""
    squares = np.square(np.sort(np.asarray(singular_values, dtype=np.float64))[::-1])
    total = squares.sum()
    return float(math.sqrt(squares[rank:].sum() / total)) if total > 0 else 0.0


def effective_ranks(segments: pd.DataFrame) -> pd.DataFrame:
    """Per (segment, layer) row: the effective rank of base and delta, keys and values."""
    out = segments[["trajectory_id", "turn_id", "segment", "preceded_by", "layer"]].copy()
    for column in ("k_base_sv", "v_base_sv", "k_delta_sv", "v_delta_sv"):
        out[column.replace("_sv", "_rank")] = [effective_rank(sv) for sv in segments[column]]
    return out


def fig2_table(segments: pd.DataFrame) -> pd.DataFrame:
    """Mean effective rank per layer (and over layers) of base and delta, keys and values."""
    ranks = effective_ranks(segments)
    columns = ["k_base_rank", "k_delta_rank", "v_base_rank", "v_delta_rank"]
    table = ranks.groupby("layer")[columns].mean()
    table.loc["mean"] = table.mean()
    return table.reset_index()


def fig7_tables(segments: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(a) mean effective rank of the corrections per layer, by what precedes the segment;
    (b) the relative error left by a rank-r truncation, mean over segments and layers."""
    ranks = effective_ranks(segments)
    ranks["delta_rank"] = (ranks["k_delta_rank"] + ranks["v_delta_rank"]) / 2
    by_layer = ranks.pivot_table(index="layer", columns="preceded_by", values="delta_rank", aggfunc="mean")
    by_layer.loc["mean"] = by_layer.mean()
    curves = []
    for preceded_by, group in segments.groupby("preceded_by"):
        for rank in TRUNCATION_RANKS:
            errors = [truncation_error(sv, rank) for column in ("k_delta_sv", "v_delta_sv") for sv in group[column]]
            curves.append({"preceded_by": preceded_by, "rank": rank, "relative_error": float(np.mean(errors))})
    return by_layer.reset_index(), pd.DataFrame(curves)


def _segment_totals(segments: pd.DataFrame) -> pd.DataFrame:
    keys = ["trajectory_id", "turn_id", "segment"]
    first = segments.groupby(keys, sort=False).first()
    totals = segments.groupby(keys, sort=False)["layer_error"].sum()
    return first[["tokens", "recompute_tokens", "deviation_removed", "attention_removed"]].assign(
        total_error=totals).reset_index()


def table2(segments: pd.DataFrame, budget: float) -> pd.DataFrame:
    """Coverage (share of the reuse error energy removed, pooled over segments) and relative
    coverage (over random selection of the same budget) of the three criteria. Layer selection
    recomputes max(1, round(budget x layers)) layers, chosen by their mean error on the other
    trajectories (an offline profile that never sees the trajectory it is scored on)."""
    layers = int(segments["layer"].max()) + 1
    chosen_layers = max(1, round(budget * layers))
    per_layer = segments.pivot_table(index=["trajectory_id", "turn_id", "segment"], columns="layer",
                                     values="layer_error", aggfunc="sum").fillna(0.0)
    totals = per_layer.sum(axis=1)
    removed_by_layers = 0.0
    for trajectory in per_layer.index.get_level_values("trajectory_id").unique():
        mine = per_layer.index.get_level_values("trajectory_id") == trajectory
        profile = per_layer[~mine].mean() if (~mine).any() else per_layer[mine].mean()
        picked = profile.sort_values(ascending=False).index[:chosen_layers]
        removed_by_layers += float(per_layer[mine][picked].to_numpy().sum())
    segment_rows = _segment_totals(segments)
    total = float(totals.sum())
    token_share = float((segment_rows["recompute_tokens"] / segment_rows["tokens"] * segment_rows["total_error"]).sum())
    rows = []
    for criterion, removed, random in (
            ("layer selection (DroidSpeak)", removed_by_layers, chosen_layers / layers * total),
            ("deviation selection (CacheBlend)",
             float((segment_rows["deviation_removed"] * segment_rows["total_error"]).sum()), token_share),
            ("attention selection (RelayCaching)",
             float((segment_rows["attention_removed"] * segment_rows["total_error"]).sum()), token_share)):
        coverage = removed / total if total > 0 else float("nan")
        rows.append({"criterion": criterion, "coverage": coverage,
                     "random_coverage": random / total if total > 0 else float("nan"),
                     "relative_coverage": removed / random if random > 0 else float("nan")})
    return pd.DataFrame(rows)


def fig3_tables(errors: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(a) per method and layer, (b) per method and agent (execution order): the normalized KV
    error (keys' and values' relative Frobenius errors, averaged), pooled over the shared segments;
    (b) averages over the layers whose K/V depend on the context (`context_layer`)."""
    def relative(frame: pd.DataFrame) -> float:
        k = math.sqrt(frame["k_sq_err"].sum() / max(frame["k_sq_ref"].sum(), 1e-30))
        v = math.sqrt(frame["v_sq_err"].sum() / max(frame["v_sq_ref"].sum(), 1e-30))
        return (k + v) / 2

    by_layer = pd.DataFrame([{"method": m, "layer": layer, "kv_error": relative(g)}
                             for (m, layer), g in errors.groupby(["method", "layer"])])
    context = errors[errors["context_layer"]]
    by_agent_layer = pd.DataFrame([{"method": m, "agent_index": a, "agent": g["agent"].iloc[0], "layer": layer,
                                    "kv_error": relative(g)}
                                   for (m, a, layer), g in context.groupby(["method", "agent_index", "layer"])])
    by_agent = by_agent_layer.groupby(["method", "agent_index", "agent"], as_index=False)["kv_error"].mean()
    return (by_layer.pivot(index="layer", columns="method", values="kv_error").reset_index(),
            by_agent.pivot(index=["agent_index", "agent"], columns="method", values="kv_error").reset_index())


# ------------------------------------------------------------------------------- reading, rendering
def read_segments(results: Path) -> pd.DataFrame:
    files = sorted(results.rglob(SEGMENTS_FILE))
    if not files:
        raise FileNotFoundError(f"no {SEGMENTS_FILE} under {results}: run `kvbench paper fig2 --run` (the "
                                "fidelity sweep measures it in its FullShared cells)")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def read_errors(results: Path) -> pd.DataFrame:
    files = sorted(results.rglob(ERRORS_FILE))
    if not files:
        raise FileNotFoundError(f"no {ERRORS_FILE} under {results}: run `kvbench paper fig3 --run`")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def _by_context(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    return [(str(name), group) for name, group in frame.groupby("context", sort=True)]


def _context_header(context: str) -> str:
    return f"## shared context {context} tokens"


def _panels(rows: int, columns: int) -> tuple[plt.Figure, np.ndarray]:
    """One column of panels per context."""
    return plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)


def _save(figure: plt.Figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def render_fig2(results: Path, out: Path) -> str:
    segments = read_segments(results)
    lines = [f"Effective rank (fewest singular values holding {ENERGY:.0%} of the energy) of the base cache (the "
             "source agent's rows of the shared segment, keys re-aligned) and of the correction (dense target - "
             f"base), over [tokens, KV heads x head dim] per layer; the dotted line is r = {PAPER_RANK}.", ""]
    figure, axes = _panels(1, len(_by_context(segments)))
    for axis, (context, group) in zip(axes[0], _by_context(segments)):
        table = fig2_table(group)
        width = int(group["feature_dim"].iloc[0])
        lines += [_context_header(context), "",
                  f"{group[['trajectory_id', 'turn_id', 'segment']].drop_duplicates().shape[0]} segments, "
                  f"{len(group['trajectory_id'].unique())} trajectories; full dimension {width}, segment lengths "
                  f"{int(group['tokens'].min())}-{int(group['tokens'].max())} tokens.", "",
                  table.to_markdown(index=False, floatfmt=".1f"), ""]
        per_layer = table[table["layer"] != "mean"]
        for column, style in (("k_base_rank", "-o"), ("k_delta_rank", "--o"), ("v_base_rank", "-s"),
                              ("v_delta_rank", "--s")):
            axis.plot(per_layer["layer"].astype(int), per_layer[column], style, label=column.replace("_rank", ""))
        axis.axhline(PAPER_RANK, linestyle=":", color="grey")
        axis.set(title=f"context {context}", xlabel="layer", ylabel="effective rank (90% energy)")
        axis.legend()
    _save(figure, out / "fig2.png")
    return "\n".join(lines)


def render_fig7(results: Path, out: Path) -> str:
    segments = read_segments(results)
    lines = ["Effective rank of the corrections by what precedes the shared segment: `pf` = only the role's "
             "system prompt (the query: a relation that recurs across requests), `ph` = dynamic shared context "
             "too (agents' outputs, after the query and earlier outputs); (b) relative error left by a rank-r "
             "truncation, mean over segments, layers, keys and values.", ""]
    contexts = _by_context(segments)
    figure, axes = _panels(2, len(contexts))
    for column, (context, group) in enumerate(contexts):
        by_layer, curves = fig7_tables(group)
        lines += [_context_header(context), "", "(a) effective rank per layer", "",
                  by_layer.to_markdown(index=False, floatfmt=".1f"), "", "(b) relative error at rank r", "",
                  curves.pivot(index="rank", columns="preceded_by", values="relative_error").reset_index()
                  .astype({"rank": str}).to_markdown(index=False, floatfmt=".3f"), ""]
        per_layer = by_layer[by_layer["layer"] != "mean"]
        for kind in [c for c in per_layer.columns if c != "layer"]:
            axes[0][column].plot(per_layer["layer"].astype(int), per_layer[kind], "-o", label=kind)
        axes[0][column].set(title=f"context {context}: effective rank", xlabel="layer")
        axes[0][column].legend()
        for kind, curve in curves.groupby("preceded_by"):
            axes[1][column].plot(curve["rank"], curve["relative_error"], "-o", label=str(kind))
        axes[1][column].set(xscale="log", xlabel="retained rank", ylabel="relative error")
        axes[1][column].legend()
    _save(figure, out / "fig7.png")
    return "\n".join(lines)


def render_table2(results: Path, out: Path) -> str:
    segments = read_segments(results)
    lines = []
    for context, group in _by_context(segments):
        budget = float(group["budget"].iloc[0])
        table = table2(group, budget)
        lines += [_context_header(context), "",
                  f"Budget {budget:.0%} of the (token, layer) entries (the paper's rho = {1 - budget:.1f}); the token "
                  f"criteria are measured at layer {int(group['check_layer'].iloc[0])} and recompute their tokens in "
                  "every layer; random selection's coverage is its expectation.", "",
                  table.to_markdown(index=False, floatfmt=".3f"), ""]
        table.to_csv(out / f"table2-{context}.csv", index=False)
    return "\n".join(lines)


def render_fig3(results: Path, out: Path) -> str:
    errors = read_errors(results)
    lines = ["KV error of the shared segments against a dense prefill of the same prompt: ||C - C_dense||_F / "
             "||C_dense||_F, keys and values averaged, pooled over segments; (b) over the layers whose K/V depend "
             "on the context.", ""]
    contexts = _by_context(errors)
    figure, axes = _panels(2, len(contexts))
    for column, (context, group) in enumerate(contexts):
        by_layer, by_agent = fig3_tables(group)
        lines += [_context_header(context), "", "(a) per layer", "",
                  by_layer.astype({"layer": str}).to_markdown(index=False, floatfmt=".4f"), "",
                  "(b) per agent, in execution order", "",
                  by_agent.astype({"agent_index": str}).to_markdown(index=False, floatfmt=".4f"), ""]
        for method in [c for c in by_layer.columns if c != "layer"]:
            axes[0][column].plot(by_layer["layer"], by_layer[method], "-o", label=method)
            axes[1][column].plot(by_agent["agent_index"], by_agent[method], "-o", label=method)
        axes[0][column].set(title=f"context {context}", xlabel="layer", ylabel="normalized KV error")
        axes[1][column].set(xlabel="agent (execution order)", ylabel="normalized KV error")
        axes[1][column].set_xticks(by_agent["agent_index"], by_agent["agent"])
        axes[0][column].legend()
    _save(figure, out / "fig3.png")
    return "\n".join(lines)
