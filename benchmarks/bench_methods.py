"""Benchmark: NonShared vs FullShared inside vLLM, four agents, QPS 0, at 2K and 8K shared tokens.

Prints, per context: p50 TTFT of the reuse turns (A1-A3) per method and their ratio (target:
FullShared >= 3x lower at 8K), the connector's materialization time per 1K reused tokens, and
the cost of saving a request's cache relative to that request's E2E (target < 10%).

    .venv/bin/python benchmarks/bench_methods.py [--contexts 2048,8192] [--trajectories 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pandas as pd

from kvbench.model.store import resolve_model
from kvbench.replay.runner import ReplayConfig, run_replay
from kvbench.replay.server import VLLMServer, method_server_config
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.schema import Trace
from kvbench.tracegen.tokenizer import load_tokenizer


def run_method(method: str, traces: dict[int, Trace], tokenizer, workdir: Path) -> dict[int, pd.DataFrame]:
    config = method_server_config(method, resolve_model(None), log_path=workdir / f"{method}-server.log")
    results = {}
    with VLLMServer(config) as server:
        for context, trace in traces.items():
            out = workdir / f"{method}-{context}"
            run_replay(ReplayConfig(trace=trace, tokenizer=tokenizer, method=method, base_urls=[server.base_url],
                                    result_dir=out, qps=0, num_warmups=1, show_progress=False))
            results[context] = pd.read_parquet(out / "requests.parquet")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--trajectories", type=int, default=4)
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    traces = {}
    for context in (int(c) for c in args.contexts.split(",")):
        header, trajectories = generate_trace(TraceSpec(shared_tokens=context, num_trajectories=args.trajectories + 1,
                                                        seed=7), tokenizer)
        traces[context] = Trace(header=header, trajectories=trajectories)
    with tempfile.TemporaryDirectory() as tmp:
        results = {m: run_method(m, traces, tokenizer, Path(tmp)) for m in ("nonshared", "fullshared")}
    print(f"{'context':>8} {'nonshared p50 TTFT ms':>22} {'fullshared p50 TTFT ms':>23} {'ratio':>6} "
          f"{'materialize ms/1K reused':>25} {'save / E2E':>11} {'failed':>7}")
    for context in traces:
        dense, shared = results["nonshared"][context], results["fullshared"][context]
        reuse_turn = lambda df: df[df["turn_id"] != "A0.r0"]  # noqa: E731
        p50_dense = reuse_turn(dense)["ttft_ms"].median()
        p50_shared = reuse_turn(shared)["ttft_ms"].median()
        stats = reuse_turn(shared)["method_stats"].map(json.loads)
        per_1k = (stats.map(lambda s: s["materialize_s"]) * 1e3 / (stats.map(lambda s: s["reused_tokens"]) / 1e3)).median()
        all_stats = shared["method_stats"].map(lambda s: json.loads(s) if s else {})
        save_share = (all_stats.map(lambda s: s.get("save_s", float("nan"))) * 1e3 / shared["e2el_ms"]).median()
        failed = int((~dense["success"]).sum() + (~shared["success"]).sum())
        print(f"{context:>8} {p50_dense:>22.1f} {p50_shared:>23.1f} {p50_dense / p50_shared:>5.1f}x "
              f"{per_1k:>25.2f} {save_share:>10.1%} {failed:>7}")


if __name__ == "__main__":
    main()
