"""Benchmark: agents reading one document at the same time (issue 51, item 7).

A fan-in workflow (A0..A(n-2) read the shared context in parallel, A(n-1) reads their outputs)
replayed at QPS 0 under NonShared, and under FullShared and KVCMAS with and without concurrent
sources (`kvbench replay --concurrent-sources`): with them, the parallel readers after the first
read its prompt's cache as soon as it is computed, while it still decodes. Prints per context:
- the parallel readers but the first (the turns concurrent sources serve): p50 TTFT, its ratio to
  NonShared's same turns with a 95% bootstrap interval over trajectories, and their reuse share;
- the first reader (the source): p50 TTFT against NonShared's (what saving its prompt costs it);
- the workflow makespan p50.

    .venv/bin/python benchmarks/bench_concurrent_readers.py [--contexts 2048,8192] [--agents 5]
        [--trajectories 6] [--warmups 1] [--output-len 32] [--model M] [--result-dir DIR] [--json FILE]

Each method's server is started once (compiled unless KVBENCH_ENFORCE_EAGER=1) and the replays
run on it one after another; the runs are kept in --result-dir for `kvbench report`.
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
from kvbench.experiment.run import replay_and_summarize
from kvbench.methods.registry import resolve_method
from kvbench.model.resolve import resolve_model
from kvbench.replay.run_config import ReplayConfig
from kvbench.server.config import method_server_config
from kvbench.server.lifecycle import running_server, wait_for_stopped_servers
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.schema import Trace
from kvbench.tracegen.tokenizer import load_tokenizer

CONFIGS = (("nonshared", True), ("fullshared", False), ("fullshared", True), ("kvcmas", False), ("kvcmas", True))


def _name(method: str, concurrent: bool) -> str:
    return method if method == "nonshared" else f"{method}{'+concurrent' if concurrent else ''}"


def _fmt(interval: Any) -> str:
    return f"{interval.ratio:.2f}x [{interval.low:.2f}, {interval.high:.2f}]"


def figures(runs: dict[str, pd.DataFrame], agents: int) -> dict[str, Any]:
    readers = [f"A{i}.r0" for i in range(1, agents - 1)]
    out: dict[str, Any] = {}
    base = runs["nonshared"]
    for name, requests in runs.items():
        later = requests[requests["turn_id"].isin(readers)]
        first = requests[requests["turn_id"] == "A0.r0"]
        ok = later[later["success"]]
        row: dict[str, Any] = {
            "readers_p50_ttft_ms": float(ok["ttft_ms"].median()),
            "readers_reuse_share": float(ok["reused_tokens"].fillna(0).sum() / max(1, ok["shared_tokens"].sum())),
            "first_p50_ttft_ms": float(first["ttft_ms"].median()),
            "failed": int((~requests["success"]).sum()),
        }
        ends = requests.groupby("trajectory_id")["end_ns"].max() - requests.groupby("trajectory_id")["scheduled_ns"].min()
        row["p50_workflow_ms"] = float(np.median(ends) / 1e6)
        if name != "nonshared":
            row["readers_vs_nonshared"] = _fmt(p50_ratio_interval(later, base[base["turn_id"].isin(readers)]))
            row["first_vs_nonshared"] = _fmt(p50_ratio_interval(first, base[base["turn_id"] == "A0.r0"]))
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--agents", type=int, default=5, help="fan-in agents: all but the last read in parallel")
    parser.add_argument("--trajectories", type=int, default=6)
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--model", default=None, help="default: the embedded kvbench:recall-v1")
    parser.add_argument("--result-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = resolve_model(args.model)
    tokenizer = load_tokenizer(args.model)
    traces = {}
    for context in (int(c) for c in args.contexts.split(",")):
        header, items = generate_trace(TraceSpec(workflow="fan-in", num_agents=args.agents, shared_tokens=context,
                                                 output_len=args.output_len, seed=0,
                                                 num_trajectories=args.trajectories + args.warmups), tokenizer)
        traces[context] = Trace(header=header, trajectories=items)
    runs: dict[int, dict[str, pd.DataFrame]] = {c: {} for c in traces}
    with (nullcontext(str(args.result_dir)) if args.result_dir else tempfile.TemporaryDirectory()) as root:
        for method in dict.fromkeys(m for m, _ in CONFIGS):
            config = method_server_config(resolve_method(method), model, max_model_len=max(traces) + 2048,
                                          log_path=Path(root) / method / "server.log")
            with running_server(config) as server:
                wait_for_stopped_servers()
                for concurrent in (c for m, c in CONFIGS if m == method):
                    for context, trace in traces.items():
                        out = Path(root) / method / f"{_name(method, concurrent)}-{context}"
                        replay_and_summarize(ReplayConfig.build(
                            trace=trace, tokenizer=tokenizer, method=resolve_method(method), base_urls=[server.base_url],
                            result_dir=out, qps=0.0, num_warmups=args.warmups, concurrent_sources=concurrent,
                            label=_name(method, concurrent), show_progress=False,
                            server_pids={server.base_url: server.process.pid}, server_failure=server.failure,
                            extra_config={"model": model, "server_command": server.command()}))
                        runs[context][_name(method, concurrent)] = run_files.load_requests(out).frame
        wait_for_stopped_servers()
    report: dict[str, Any] = {}
    for context, by_name in runs.items():
        fig = figures(by_name, args.agents)
        report[str(context)] = fig
        print(f"\nfan-in of {args.agents} agents, {context} shared tokens, QPS 0, {args.trajectories} trajectories "
              f"({args.agents - 2} parallel readers after the first per trajectory)")
        for name, row in fig.items():
            print(f"  {name:22s} readers p50 {row['readers_p50_ttft_ms']:7.1f} ms "
                  f"{row.get('readers_vs_nonshared', ''):24s} reuse {row['readers_reuse_share']:.2f}; "
                  f"first reader p50 {row['first_p50_ttft_ms']:7.1f} ms {row.get('first_vs_nonshared', '')}; "
                  f"workflow p50 {row['p50_workflow_ms']:7.1f} ms; failed {row['failed']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
