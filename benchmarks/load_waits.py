"""Where connector loads wait: for each result directory of a `kvbench replay` run (with
`--max-load-tokens-per-step N`; a load in one step never waits in the connector), the first
agents' wait before their load's first layer, the gaps between its layers, and which other loads
ran engine steps while they waited.

    .venv/bin/python benchmarks/load_waits.py RESULT_DIR [RESULT_DIR ...]

Reads each request's `method_stats` (`load_s`, `load_step_offsets_s`). A load's creation time is
estimated as its first token minus `load_s` (the forward after the load is left out), so the
counts of overlapping steps are approximate. Loads are classed by turn: the first agent (`A0`,
and `A0-ref+dense` where a non-chained method prefilled a reference and then computed the query
densely), reuse turns that computed their shared query densely (`reuse-dense`, more than half the
prompt recomputed), and the other reuse turns (`reuse`).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd


def load_steps(result_dir: Path) -> list[dict]:
    requests = pd.read_parquet(result_dir / "requests.parquet")
    loads = []
    for _, row in requests.iterrows():
        stats = row["method_stats"]
        stats = json.loads(stats) if isinstance(stats, str) else (stats or {})
        offsets = stats.get("load_step_offsets_s")
        if not offsets:
            continue  # no connector load (plain vLLM), or results from before the offsets were recorded
        first_agent = row["turn_id"].startswith("A0.")
        dense = row["recomputed_tokens"] > row["prompt_tokens"] / 2
        kind = ("A0-ref+dense" if dense and stats.get("reference_prefill_s") else "A0") if first_agent \
            else ("reuse-dense" if dense else "reuse")
        created = row["first_token_ns"] / 1e9 - stats["load_s"]
        loads.append({"kind": kind, "created": created, "steps": [created + t for t in offsets],
                      "wait": offsets[0], "gaps": np.diff(offsets).tolist(), "ttft_ms": row["ttft_ms"]})
    return loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result_dirs", nargs="+", type=Path)
    args = parser.parse_args()
    for result_dir in args.result_dirs:
        loads = load_steps(result_dir)
        first = [load for load in loads if load["kind"].startswith("A0")]
        if not first:
            print(f"{result_dir}: no first-agent loads with step times (a plain vLLM method, or older results)")
            continue
        held = Counter()  # steps other loads ran while a first agent waited for its first layer
        for load in first:
            start, stop = load["created"], load["created"] + load["wait"]
            for other in loads:
                if other is not load:
                    held[other["kind"]] += sum(start <= t < stop for t in other["steps"])
        gaps = [gap for load in first for gap in load["gaps"]]
        print(f"{result_dir}: first agents {len(first)}, p50 TTFT {np.median([f['ttft_ms'] for f in first]):.0f} ms; "
              f"wait before the first layer p50 {np.median([f['wait'] for f in first]):.2f} s, "
              f"sum {sum(f['wait'] for f in first):.1f} s; gaps between layers {min(gaps):.2f}-{max(gaps):.2f} s")
        print(f"  loads by kind: {dict(sorted(Counter(load['kind'] for load in loads).items()))}; "
              f"steps of loads computing an 8K-class prefill: {sum(len(x['steps']) for x in loads if x['kind'] != 'reuse')}")
        print(f"  steps other loads ran while a first agent waited: {dict(sorted((k, v) for k, v in held.items() if v))}")


if __name__ == "__main__":
    main()
