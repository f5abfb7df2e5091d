"""Benchmark: gen-trace of 100 trajectories with 32K shared tokens (< 10 s) and reading it back (< 2 s).

    .venv/bin/python benchmarks/bench_tracegen.py [--num-trajectories 100] [--shared-tokens 32768]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.tokenizer import load_tokenizer
from kvbench.tracegen.trace_files import read_trace, write_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-trajectories", type=int, default=100)
    parser.add_argument("--shared-tokens", type=int, default=32768)
    args = parser.parse_args()
    tokenizer = load_tokenizer(None)  # loaded once, outside the timed region, as the CLI does
    spec = TraceSpec(num_trajectories=args.num_trajectories, shared_tokens=args.shared_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        started = time.perf_counter()
        header, trajectories = generate_trace(spec, tokenizer)
        size = write_trace(path, header, trajectories)
        generate_s = time.perf_counter() - started
        started = time.perf_counter()
        trace = read_trace(path)
        read_s = time.perf_counter() - started
    turns = sum(len(t.turns) for t in trace.trajectories)
    print(f"trajectories={len(trace.trajectories)} turns={turns} shared_tokens={args.shared_tokens}")
    print(f"gen_trace_s={generate_s:.2f} (target < 10)  read_s={read_s:.2f} (target < 2)  "
          f"trace_bytes={size:,}")


if __name__ == "__main__":
    main()
