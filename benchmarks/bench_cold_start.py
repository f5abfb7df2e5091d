"""Benchmark: what a reuse method costs from a cold start and in its steady state (issue 51, item 2).

Replays one sequential four-agent trace per context under NonShared, FullShared and KVCMAS at
QPS 0, twice: cold (the method's state empty: its first trajectories' segments go dense while its
anchor pools fill) and primed (the warm-ups' anchors kept, `--prime-method-state`). Prints per
context and start:
- reuse turns (a turn with a shared segment some earlier turn holds): p50 TTFT per method, and
  KVCMAS / FullShared and KVCMAS / NonShared with 95% bootstrap intervals over trajectories
  (targets, cold at 2K: KVCMAS / FullShared <= 1.5);
- first agents (turns that reuse nothing): p50 TTFT and the ratio to NonShared's
  (target <= 1.15);
- FullShared / NonShared on reuse turns: where it is above 1, claiming the turn costs more than
  prefilling it;
- KVCMAS's realized rho and the share of its segment decisions that went dense for want of
  anchors (`dense_few_anchors`);
- the warm-ups' wall time per trajectory (anchor building included), KVCMAS / NonShared
  (issue 64's target on a deep model: <= 2);
- the measured trajectories' mean end-to-end time (where work moved out of a TTFT still counts).

`--kvcmas-prematch` adds KVCMAS with `prematch` on (a saved turn's segments matched against the
anchor pools after its first token, in its decode steps, not inside the next edge's TTFT), in the
same run, as `kvcmas-prematch`.

    .venv/bin/python benchmarks/bench_cold_start.py [--contexts 1024,2048,8192] [--trajectories 8]
        [--warmups 2] [--output-len 128] [--starts cold,primed] [--model M] [--task T]
        [--kvcmas-prematch] [--result-dir DIR] [--json FILE]

The runs are `kvbench sweep`s (kept in --result-dir for `kvbench report` / `kvbench profile`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench import run_files
from kvbench.analysis.intervals import p50_ratio_interval
from kvbench.experiment.sweep import MethodConfig, SweepSpec
from kvbench.experiment.sweep_runner import run_sweep

METHODS = (MethodConfig("nonshared"), MethodConfig("fullshared"), MethodConfig("kvcmas"))
PREMATCH = MethodConfig("kvcmas", {"prematch": True}, label="kvcmas-prematch")
KVCMAS_VARIANTS = ("kvcmas", "kvcmas-prematch")  # rows compared with NonShared and FullShared, where run


def reuse_turns(requests: pd.DataFrame) -> pd.DataFrame:
    return requests[requests["reusable_tokens"].fillna(0) > 0]


def first_agents(requests: pd.DataFrame) -> pd.DataFrame:
    return requests[requests["reusable_tokens"].fillna(0) == 0]


def _ratio(num: pd.DataFrame, den: pd.DataFrame) -> dict[str, float]:
    interval = p50_ratio_interval(num, den)
    return {"ratio": interval.ratio, "low": interval.low, "high": interval.high}


def _decisions(requests: pd.DataFrame) -> tuple[int, int]:
    """(segment decisions, of which dense for want of anchors) over the run's requests."""
    total = dense = 0
    for raw in requests["method_stats"].dropna():
        for decision in json.loads(raw).get("decisions", []):
            total += 1
            dense += decision.get("decision") == "dense_few_anchors"
    return total, dense


def cell_figures(runs: dict[str, pd.DataFrame], summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Figures of one (context, start) cell; `runs` and `summaries` by method row name."""
    reuse = {m: reuse_turns(r) for m, r in runs.items()}
    first = {m: first_agents(r) for m, r in runs.items()}
    out: dict[str, Any] = {
        "reuse_p50_ms": {m: float(np.median(r["ttft_ms"].dropna())) for m, r in reuse.items()},
        "first_p50_ms": {m: float(np.median(r["ttft_ms"].dropna())) for m, r in first.items()},
        "reuse_turns": len(reuse["nonshared"]), "first_turns": len(first["nonshared"]),
        "fullshared_over_nonshared": _ratio(reuse["fullshared"], reuse["nonshared"]),
        "first_fullshared_over_nonshared": _ratio(first["fullshared"], first["nonshared"]),
        "warmup_per_trajectory_s": {m: s.get("warmup_per_trajectory_s") for m, s in summaries.items()},
        "trajectory_e2e_ms": {m: s.get("mean_trajectory_e2e_ms") for m, s in summaries.items()},
        "failed": {m: int((~r["success"]).sum()) for m, r in runs.items()},
    }
    for name in (v for v in KVCMAS_VARIANTS if v in runs):
        prefix = name.replace("-", "_")
        total, dense = _decisions(runs[name])
        out.update({
            f"{prefix}_over_fullshared": _ratio(reuse[name], reuse["fullshared"]),
            f"{prefix}_over_nonshared": _ratio(reuse[name], reuse["nonshared"]),
            f"first_{prefix}_over_nonshared": _ratio(first[name], first["nonshared"]),
            f"{prefix}_realized_rho": summaries[name].get("realized_rho"),
            f"{prefix}_dense_few_anchors_share": dense / total if total else None,
        })
    return out


def _fmt(r: dict[str, float]) -> str:
    return f"{r['ratio']:.2f}x [{r['low']:.2f}, {r['high']:.2f}]"


def print_cell(context: int, start: str, fig: dict[str, Any]) -> None:
    reuse, first = fig["reuse_p50_ms"], fig["first_p50_ms"]
    print(f"\n{context} shared tokens, {start} start ({fig['reuse_turns']} reuse turns, {fig['first_turns']} first agents)")
    print("  reuse turns p50 TTFT ms: " + ", ".join(f"{m} {v:.1f}" for m, v in reuse.items()))
    print(f"    FullShared / NonShared {_fmt(fig['fullshared_over_nonshared'])}")
    print("  first agents p50 TTFT ms: " + ", ".join(f"{m} {v:.1f}" for m, v in first.items()))
    print(f"    FullShared / NonShared {_fmt(fig['first_fullshared_over_nonshared'])}")
    for name in (v for v in KVCMAS_VARIANTS if v in reuse):
        prefix = name.replace("-", "_")
        share = fig[f"{prefix}_dense_few_anchors_share"]
        print(f"  {name}: reuse turns / FullShared {_fmt(fig[f'{prefix}_over_fullshared'])}, / NonShared "
              f"{_fmt(fig[f'{prefix}_over_nonshared'])}; first agents / NonShared "
              f"{_fmt(fig[f'first_{prefix}_over_nonshared'])}")
        print(f"    realized rho {fig[f'{prefix}_realized_rho']}, decisions dense for want of anchors "
              f"{'n/a' if share is None else f'{share:.0%}'}")
    print(f"  failed requests {fig['failed']}")
    e2e = fig["trajectory_e2e_ms"]
    print("  measured trajectories, mean end-to-end s: " + ", ".join(
        f"{m} {v / 1000:.1f}" for m, v in e2e.items() if v is not None))
    warmup = fig["warmup_per_trajectory_s"]
    if warmup.get("nonshared"):
        print("  warm-up per trajectory s: " + ", ".join(f"{m} {v:.1f}" for m, v in warmup.items() if v) + "; "
              + ", ".join(f"{m} / NonShared {warmup[m] / warmup['nonshared']:.2f}x"
                          for m in KVCMAS_VARIANTS if warmup.get(m)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,2048,8192")
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--starts", default="cold,primed", help="cold, primed or both")
    parser.add_argument("--model", default=None, help="default: the embedded kvbench:recall-v1")
    parser.add_argument("--task", default="none", help="the traces' task (gen-trace --task), e.g. role-lookup")
    parser.add_argument("--kvcmas-prematch", action="store_true",
                        help="add KVCMAS with prematch on (kvcmas-prematch) to the same run")
    parser.add_argument("--result-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write every figure here too")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    figures: dict[str, Any] = {}
    with (nullcontext(str(args.result_dir)) if args.result_dir else tempfile.TemporaryDirectory()) as root:
        for start in args.starts.split(","):
            if start not in ("cold", "primed"):
                parser.error(f"--starts: cold or primed, got {start!r}")
            methods = [*METHODS, *([PREMATCH] if args.kvcmas_prematch else [])]
            spec = SweepSpec(methods=methods, shared_tokens=contexts, qps=[0.0],
                             num_trajectories=args.trajectories, num_warmups=args.warmups,
                             prime_method_state=start == "primed", output_len=args.output_len, model=args.model,
                             task=args.task)
            cells = run_sweep(spec, Path(root) / start)
            for context in contexts:
                mine = [c for c in cells if c.shared_tokens == context]
                runs = {c.method.name: run_files.load_requests(c.path).frame for c in mine}
                summaries = {c.method.name: json.loads((c.path / run_files.SUMMARY).read_text()) for c in mine}
                fig = cell_figures(runs, summaries)
                figures[f"{context}/{start}"] = fig
                print_cell(context, start, fig)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
