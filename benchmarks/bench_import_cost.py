"""What kvbench's processes import and how long they take to start: `kvbench --help`, and a
replay client (`kvbench replay --base-url URL`) against the stand-in server on loopback. A
client needs neither torch nor vLLM: it prints the heavy packages each process loaded.

    python benchmarks/bench_import_cost.py --repeats 5
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from kvbench.replay.stub import StubServer

HEAVY = ("torch", "vllm", "transformers", "triton", "scipy", "matplotlib", "pandas")
PROBE = """
import json, sys, time
start = time.perf_counter()
from kvbench.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
except SystemExit:
    pass
heavy = sorted({m.split('.')[0] for m in sys.modules} & set(json.loads(%r)))
print('\\nIMPORTS ' + json.dumps({"heavy": heavy, "modules": len(sys.modules), "s": time.perf_counter() - start}))
"""


def _probe(args: list[str]) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE % json.dumps(HEAVY), *args], capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith("IMPORTS ")]
    if done.returncode != 0 or not lines:
        raise click.ClickException(f"kvbench {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return wall, json.loads(lines[-1].removeprefix("IMPORTS "))


@click.command()
@click.option("--repeats", default=5, show_default=True, help="runs of each process (the median is printed)")
def main(repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, StubServer() as stub:
        trace = Path(tmp) / "trace.jsonl"
        subprocess.run([sys.executable, "-m", "kvbench", "gen-trace", "-o", str(trace), "--num-trajectories", "4",
                        "--shared-tokens", "256", "--output-len", "8"], check=True, capture_output=True)
        processes = {"kvbench --help": ["--help"]}
        for i in range(repeats):
            processes[f"replay client #{i}"] = ["replay", "--trace", str(trace), "--base-url", stub.base_url, "--qps",
                                                "0", "--result-dir", str(Path(tmp) / f"run{i}")]
        rows: dict[str, list[tuple[float, dict]]] = {"kvbench --help": [], "replay client": []}
        for name, args in processes.items():
            for _ in range(repeats if name == "kvbench --help" else 1):
                rows[name.split(" #")[0]].append(_probe(args))
    for name, runs in rows.items():
        wall = statistics.median(w for w, _ in runs)
        info = runs[-1][1]
        click.echo(f"{name}: {wall:.2f} s wall (median of {len(runs)}), {info['modules']} modules, "
                   f"heavy: {', '.join(info['heavy']) or 'none'}")


if __name__ == "__main__":
    main()
