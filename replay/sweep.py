"""`kvbench sweep`: a grid of replays (methods x contexts x QPS x agents x rounds x repeats) in one
directory, one server start per method configuration, resumable cell by cell."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbench.tracegen.generate import TraceSpec

SWEEP_FILE = "sweep.json"


@dataclass(frozen=True)
class MethodConfig:
    method: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """Directory-safe name, e.g. `kvcmas` or `kvcmas-V10-tau0.3`."""
        return self.method + "".join(f"-{k}{v}" for k, v in sorted(self.params.items()))


@dataclass
class SweepSpec:
    methods: list[MethodConfig]
    shared_tokens: list[int] = field(default_factory=lambda: [2048])
    qps: list[float] = field(default_factory=lambda: [0.0])
    agents: list[int] = field(default_factory=lambda: [4])
    rounds: list[int] = field(default_factory=lambda: [1])
    workflow: str = "sequential"
    output_len: int = 128
    num_trajectories: int = 8
    num_warmups: int = 1
    prime_method_state: bool = False
    repeats: int = 1
    seed: int = 0
    model: str | None = None
    cpu_kv_cache_gib: float = 2.0
    request_timeout_s: float = 1800.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SweepSpec:
        data = dict(data)
        data["methods"] = [MethodConfig(**m) for m in data["methods"]]
        return cls(**data)

    def extends(self, stored: SweepSpec) -> bool:
        """This grid is `stored` (a sweep already on disk) with possibly more method
        configurations and nothing else changed: its finished cells stay valid."""
        return (replace(self, methods=stored.methods) == stored
                and all(method in self.methods for method in stored.methods))

    def trace_specs(self) -> dict[str, TraceSpec]:
        specs = {}
        for context, agents, rounds in itertools.product(self.shared_tokens, self.agents, self.rounds):
            spec = TraceSpec(num_agents=agents, rounds=rounds, workflow=self.workflow, shared_tokens=context,
                             output_len=self.output_len, num_trajectories=self.num_trajectories + self.num_warmups,
                             seed=self.seed)
            specs[f"ctx{context}-a{agents}-r{rounds}"] = spec
        return specs

    def cells(self) -> list[tuple[MethodConfig, str, float, int]]:
        """(method configuration, trace id, qps, repeat), grouped by method configuration."""
        return [(m, t, q, k) for m in self.methods for t in self.trace_specs() for q in self.qps
                for k in range(self.repeats)]


def cell_dir(root: Path, method: MethodConfig, trace_id: str, qps: float, repeat: int) -> Path:
    return root / "runs" / method.name / f"{trace_id}-qps{qps:g}-rep{repeat}"


def cell_done(path: Path) -> bool:
    """A cell whose run ended normally (not aborted, not stopped by a signal): others resume."""
    summary = path / "summary.json"
    if not summary.exists():
        return False
    written = json.loads(summary.read_text())
    return written.get("aborted") is None and written.get("interrupted") is None


def run_sweep(spec: SweepSpec, root: Path, on_cell: Callable[[str], None] | None = None) -> list[Path]:
    """Run every cell not already complete; returns the run directories of all cells."""
    from kvbench.model.store import resolve_model
    from kvbench.replay.runner import ReplayConfig, ReplayError, run_replay
    from kvbench.replay.server import VLLMServer, method_server_config
    from kvbench.tracegen.generate import generate_trace
    from kvbench.tracegen.schema import Trace, read_trace, write_trace
    from kvbench.tracegen.tokenizer import load_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    spec_path = root / SWEEP_FILE
    if spec_path.exists() and not spec.extends(SweepSpec.from_json(json.loads(spec_path.read_text()))):
        raise ValueError(f"{root} holds a different sweep ({spec_path}); use another directory "
                         "(a sweep may only grow by methods)")
    spec_path.write_text(json.dumps(spec.to_json(), indent=2) + "\n")
    tokenizer = load_tokenizer(spec.model)
    model = resolve_model(spec.model)
    traces: dict[str, Trace] = {}
    for trace_id, trace_spec in spec.trace_specs().items():
        path = root / "traces" / f"{trace_id}.jsonl"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_trace(path, *generate_trace(trace_spec, tokenizer))
        traces[trace_id] = read_trace(path)
    dirs = []
    for method, cells in itertools.groupby(spec.cells(), key=lambda cell: cell[0]):
        todo = []
        for _, trace_id, qps, repeat in cells:
            path = cell_dir(root, method, trace_id, qps, repeat)
            dirs.append(path)
            if cell_done(path):
                if on_cell:
                    on_cell(f"{method.name} {path.name} (done earlier)")
            else:
                todo.append((trace_id, qps, repeat, path))
        if not todo:
            continue
        server_config = method_server_config(method.method, model, method.params,
                                             cpu_kv_cache_gib=spec.cpu_kv_cache_gib,
                                             log_path=root / "runs" / method.name / "server.log")
        with VLLMServer(server_config) as server:  # one start per method configuration
            for trace_id, qps, repeat, path in todo:
                config = ReplayConfig(
                    trace=traces[trace_id], tokenizer=tokenizer, method=method.method, base_urls=[server.base_url],
                    result_dir=path, qps=qps, seed=spec.seed + repeat, num_warmups=spec.num_warmups,
                    prime_method_state=spec.prime_method_state,
                    label=method.name, resume=(path / "config.json").exists(), method_params=method.params,
                    request_timeout_s=spec.request_timeout_s, show_progress=False,
                    server_pids={server.base_url: server.process.pid},  # type: ignore[union-attr]
                    metadata={"sweep_trace": trace_id, "repeat": str(repeat)},
                    extra_config={"model": model, "method_params": method.params, "method_config": method.name})
                try:
                    run_replay(config)
                except ReplayError as exc:
                    if not server.is_running():
                        raise
                    (path / "error.txt").write_text(str(exc) + "\n")
                if on_cell:
                    on_cell(f"{method.name} {path.name}")
    return dirs
