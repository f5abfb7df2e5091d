"""Benchmark: the replayer's own overhead against a stub server on loopback that streams at once.

Replays 2,000 requests (1,000 two-agent trajectories at 25 trajectories/s = 50 requests/s) and
prints the p99 of (sent - scheduled) lag (target < 2 ms) and of client-side TTFT overhead
(client TTFT minus the stub's own receive-to-first-chunk time). The stub runs in its own process.

    .venv/bin/python benchmarks/bench_replay_overhead.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.methods.registry import resolve_method
from kvbench.replay.runner import ReplayConfig, run_replay
from kvbench.server.lifecycle import free_port
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.schema import Trace
from kvbench.tracegen.tokenizer import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=1000)
    parser.add_argument("--qps", type=float, default=25.0, help="trajectories/s (2 requests each)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)
    header, trajectories = generate_trace(TraceSpec(num_agents=2, shared_tokens=64, output_len=4,
                                                    num_trajectories=args.trajectories), tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        timings_path = Path(tmp) / "stub-timings.json"
        stub = subprocess.Popen([sys.executable, "-m", "kvbench.replay.stub", "--port", str(port),
                                 "--timings-out", str(timings_path)], stdout=subprocess.PIPE, text=True)
        try:
            stub.stdout.readline()  # "stub serving on ..."
            base_url = f"http://127.0.0.1:{port}"
            urllib.request.urlopen(f"{base_url}/health", timeout=10)
            config = ReplayConfig.build(trace=Trace(header=header, trajectories=trajectories), tokenizer=tokenizer,
                                  method=resolve_method("nonshared"), base_urls=[base_url], result_dir=Path(tmp) / "run",
                                  qps=args.qps, show_progress=False)
            started = time.perf_counter()
            run_replay(config)
            wall = time.perf_counter() - started
        finally:
            stub.terminate()
            stub.wait(30)
        requests = pd.read_parquet(Path(tmp) / "run" / "requests.parquet")
        server = json.loads(timings_path.read_text())
    server_ttft_ms = requests["request_id"].map(lambda r: (server[r][1] - server[r][0]) / 1e6)
    lag_ms = (requests["sent_ns"] - requests["scheduled_ns"]) / 1e6
    overhead_ms = requests["ttft_ms"] - server_ttft_ms
    first = requests[requests["turn_id"] == "A0.r0"]
    achieved = len(requests) / wall
    print(f"requests={len(requests)} failed={(~requests['success']).sum()} wall_s={wall:.1f} "
          f"achieved_rps={achieved:.1f}")
    print(f"p50_send_lag_ms={np.percentile(lag_ms, 50):.3f} p99_send_lag_ms={np.percentile(lag_ms, 99):.3f} "
          f"(target < 2)  p99_send_lag_first_turns_ms={np.percentile((first['sent_ns'] - first['scheduled_ns']) / 1e6, 99):.3f}")
    print(f"p50_ttft_overhead_ms={np.percentile(overhead_ms, 50):.3f} "
          f"p99_ttft_overhead_ms={np.percentile(overhead_ms, 99):.3f}")


if __name__ == "__main__":
    main()
