"""`kvbench sweep`'s grid: replays (methods x contexts x QPS x agents x rounds x repeats) in one
directory, where each cell's results are, and the inputs every cell reads (traces generated once,
the model, adapters). kvbench.experiment.sweep_runner runs it, resumable cell by cell, one server
start per method configuration; kvbench.experiment.ray_sweep runs it on a Ray cluster.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbench import run_files
from kvbench.methods.api.spec import ChosenMethod
from kvbench.tracegen.generate import TraceSpec, task_roles

SWEEP_FILE = "sweep.json"
QUALITY_BASELINE = "quality-baseline"  # config.json's `sweep_role` of a sweep's reference and floor runs


@dataclass(frozen=True)
class MethodConfig:
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    label: str | None = None  # the row's name in tables; derived from method and params by default
    # The reuse ratio its threshold is calibrated to on its server before its cells (sweep
    # --target-rho; kvbench.experiment.sweep_calibration); None: its parameters as given.
    target_rho: float | None = None

    @functools.cached_property
    def chosen(self) -> ChosenMethod:
        """The method looked up and its parameters checked, once per configuration (ValueError)."""
        from kvbench.methods.registry import resolve_method

        return resolve_method(self.method, self.params)

    @property
    def name(self) -> str:
        """Directory-safe name, e.g. `kvcmas`, `kvcmas-V10-tau0.3` or `kvcmas-rho0.8` (or the label)."""
        return self.label or self.method + "".join(f"-{k}{v}" for k, v in sorted(self.params.items())) + (
            f"-rho{self.target_rho:g}" if self.target_rho is not None else "")


# The plain NonShared configuration: the one whose server also runs a sweep's quality references.
PLAIN_NONSHARED = MethodConfig("nonshared")


@dataclass(frozen=True)
class SweepPoint:
    """One (context, QPS) of a grid given point by point, with its own trajectory count and
    repeats (e.g. few trajectories single-stream, many under load)."""

    shared_tokens: int
    qps: float
    num_trajectories: int | None = None  # default: the sweep's
    repeats: int | None = None  # default: the sweep's


@dataclass(frozen=True)
class SweepCell:
    """One replay of the grid and where its results are."""

    method: MethodConfig
    trace_id: str
    shared_tokens: int
    qps: float
    num_trajectories: int
    repeat: int
    path: Path


@dataclass
class SweepSpec:
    methods: list[MethodConfig]
    shared_tokens: list[int] = field(default_factory=lambda: [2048])
    qps: list[float] = field(default_factory=lambda: [0.0])
    # Instead of shared_tokens x qps: explicit points (the two lists are then ignored).
    points: list[SweepPoint] | None = None
    agents: list[int] = field(default_factory=lambda: [4])
    rounds: list[int] = field(default_factory=lambda: [1])
    workflow: str = "sequential"
    task: str = "none"  # "recall" / "role-recall": a scored task trace (its roles preset too)
    output_len: int = 128
    num_trajectories: int = 8
    num_warmups: int = 1
    prime_method_state: bool = False
    repeats: int = 1
    seed: int = 0  # the traces'; repeat k draws its arrivals with seed + k
    model: str | None = None
    cpu_kv_cache_gib: float = 2.0
    request_timeout_s: float = 1800.0
    temperature: float = 0.0  # 0: greedy; above it each repeat samples (the paper's Table 5 spread)
    save_prompt_ids: bool = False
    # Quality beside speed: per trace, a NonShared reference and a no-shared-context floor run
    # (QPS 0, under quality/), every cell recording first-token logprobs, and every cell compared
    # with them afterwards (quality.parquet, PGR; the gain over FullShared's cell where there is one).
    quality: bool = False
    # The measurement protocol of every cell (replay/protocol.py): "paper" and "paper-decode" replay
    # each turn on the NonShared reference run's outputs (quality/<trace>/reference, run first).
    protocol: str = "free"
    goodput: dict[str, float] = field(default_factory=dict)  # latency bounds of every cell (analysis/goodput.py)
    # A loaded cell whose backlog and TTFT grow without bound stops early, marked saturated
    # (kvbench.replay.saturation), instead of running its whole queue.
    stop_on_saturation: bool = True
    # More arguments of `method_server_config` (JSON values): max_load_tokens_per_step,
    # max_store_bytes, max_model_len, extra_args...
    server_options: dict[str, Any] = field(default_factory=dict)
    # Benchmark workloads instead of generated contexts (`kvbench paper table1`): task -> its data
    # file (None: HumanEval's packaged problems). One trace per task, of num_trajectories items
    # (plus the warm-ups'); shared_tokens does not apply (the question is the shared segment).
    benchmarks: dict[str, str | None] = field(default_factory=dict)
    roles: str | None = None  # the role preset (None: the task's)
    # role -> PEFT folder of its LoRA adapter (gen-trace --adapter): every server serves them all
    adapters: dict[str, str] = field(default_factory=dict)
    # Several instances per method configuration (kvbench.server.instances), routed alike in every
    # cell, sharing caches through a Mooncake master started for each configuration unless not.
    instances: int = 1
    routing: str = "trajectory"
    shared_tier: bool = True
    # Every method configuration's server up side by side, their cells taking turns one cell each in
    # a rotating order (kvbench.experiment.sweep_runner): drift on the machine falls on every method
    # alike, and each (trace, QPS, repeat) is one comparison a report pairs within. A sweep resumes
    # only as it began (its cells pair within their comparisons, or by workload).
    interleave: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SweepSpec:
        data = dict(data)
        data["methods"] = [MethodConfig(**m) for m in data["methods"]]
        if data.get("points") is not None:
            data["points"] = [SweepPoint(**p) for p in data["points"]]
        return cls(**data)

    def extends(self, stored: SweepSpec) -> bool:
        """This grid is `stored` (a sweep already on disk) with possibly more method
        configurations and nothing else changed: its finished cells stay valid."""
        return (replace(self, methods=stored.methods) == stored
                and all(method in self.methods for method in stored.methods))

    def grid_points(self) -> list[SweepPoint]:
        """The (context, QPS) points with their trajectory counts and repeats resolved."""
        contexts = [0] if self.benchmarks else self.shared_tokens
        points = self.points if self.points is not None else [
            SweepPoint(c, q) for c, q in itertools.product(contexts, self.qps)]
        return [SweepPoint(p.shared_tokens, p.qps, p.num_trajectories or self.num_trajectories,
                           p.repeats or self.repeats) for p in points]

    def trace_specs(self) -> dict[str, TraceSpec]:
        """One trace per (context, agents, rounds), long enough for its longest cell: every cell of
        a context replays the same trajectories (a longer cell more of them)."""
        longest: dict[int, int] = {}
        for point in self.grid_points():
            longest[point.shared_tokens] = max(longest.get(point.shared_tokens, 0), point.num_trajectories or 0)
        specs = {}
        for task, data in self.benchmarks.items():  # the paper's fixed shape: four agents, one round
            specs[benchmark_trace_id(task)] = TraceSpec(
                task=task, data=data, limit=max(longest.values()) + self.num_warmups, shared_tokens=0,
                output_len=self.output_len, seed=self.seed, qps=0.0)
        if self.benchmarks:
            return specs
        for context, agents, rounds in itertools.product(longest, self.agents, self.rounds):
            specs[trace_id(context, agents, rounds)] = TraceSpec(
                num_agents=agents, rounds=rounds, workflow=self.workflow, shared_tokens=context, task=self.task,
                roles=self.roles or task_roles(self.task), adapters=dict(self.adapters) or None,
                output_len=self.output_len, num_trajectories=longest[context] + self.num_warmups, seed=self.seed)
        return specs

    def cells(self, root: Path) -> list[SweepCell]:
        """Every replay of the grid, grouped by method configuration."""
        cells = []
        workloads = ([(benchmark_trace_id(task), 4, 1) for task in self.benchmarks] if self.benchmarks else
                     [(None, agents, rounds) for agents, rounds in itertools.product(self.agents, self.rounds)])
        for method, point, (benchmark, agents, rounds) in itertools.product(self.methods, self.grid_points(),
                                                                             workloads):
            trace = benchmark or trace_id(point.shared_tokens, agents, rounds)
            for repeat in range(point.repeats or 1):
                cells.append(SweepCell(method, trace, point.shared_tokens, point.qps, point.num_trajectories or 0,
                                       repeat, cell_dir(root, method, trace, point.qps, repeat)))
        return cells


def trace_id(context: int, agents: int, rounds: int) -> str:
    return f"ctx{context}-a{agents}-r{rounds}"


def benchmark_trace_id(task: str) -> str:
    return f"{task}-a4-r1"


def cell_dir(root: Path, method: MethodConfig, trace: str, qps: float, repeat: int) -> Path:
    return root / "runs" / method.name / f"{trace}-qps{qps:g}-rep{repeat}"


def quality_dirs(root: Path, trace: str) -> tuple[Path, Path]:
    """The NonShared reference and the no-shared-context floor of a trace."""
    return root / "quality" / trace / "reference", root / "quality" / trace / "floor"


def cell_done(path: Path) -> bool:
    """A cell whose run ended normally (not aborted, not stopped by a signal): others resume."""
    summary = path / run_files.SUMMARY
    if not summary.exists():
        return False
    written = json.loads(summary.read_text())
    return written.get("aborted") is None and written.get("interrupted") is None


AfterCell = Callable[[SweepCell, Any, dict[str, Any]], None]  # (cell, its running VLLMServer, summary)


@dataclass
class SweepInputs:
    """What every cell of a sweep reads: its traces (generated once into the folder), their
    tokenizer, the resolved model and the LoRA adapters the servers serve.

    `model`, `model_identity` and `trace_paths` are what runs record (the sweep folder's, read by
    its analysis); `served_model` is where a cell's server loads the model from when that differs
    (a cluster worker's own copy, kvbench.experiment.ray_inputs); `recorded_root`, where runs say
    their reference run is when they run in a worker's scratch folder."""

    tokenizer: Any
    model: str
    traces: dict[str, Any]
    lora_modules: dict[str, str]
    trace_paths: dict[str, Path] = field(default_factory=dict)
    model_identity: str | None = None
    served_model: str | None = None
    recorded_root: Path | None = None  # a cluster worker's: the driver's sweep folder, recorded for its scratch one

    def server_config(self, spec: SweepSpec, root: Path, method: MethodConfig) -> Any:
        """The server of one method configuration (its log in the configuration's folder)."""
        from kvbench.server.config import method_server_config

        return method_server_config(method.chosen, self.served_model or self.model,
                                    **spec.server_options, cpu_kv_cache_gib=spec.cpu_kv_cache_gib,
                                    lora_modules=self.lora_modules, log_path=root / "runs" / method.name / "server.log")

    def recorded(self, trace_id: str) -> dict[str, Any]:
        """The model and trace a run of `trace_id` records in its config.json."""
        return {"model": self.model, "model_identity": self.model_identity, "trace_path": str(self.trace_paths[trace_id])}


def prepare_sweep(spec: SweepSpec, root: Path) -> SweepInputs:
    """Record the sweep's spec in its folder (refusing another sweep's folder), generate its traces
    once, and check consent for model-written code before any server starts."""
    from kvbench.experiment.run import require_consent_for
    from kvbench.model.resolve import resolve_model
    from kvbench.model.store import model_identity
    from kvbench.tracegen.generate import generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer
    from kvbench.tracegen.trace_files import read_trace, write_trace

    spec_path = root / SWEEP_FILE
    stored = SweepSpec.from_json(json.loads(spec_path.read_text())) if spec_path.exists() else None
    if stored is not None and stored.interleave != spec.interleave and spec.extends(replace(stored, interleave=spec.interleave)):
        raise ValueError(f"{root} was swept {'with' if stored.interleave else 'without'} --interleave: resume it the "
                         "same way (its cells pair within each repeat's comparison only when all ran interleaved)")
    if stored is not None and not spec.extends(stored):
        raise ValueError(f"{root} holds a different sweep ({spec_path}); use another directory "
                         "(a sweep may only grow by methods)")
    run_files.write_text_atomic(spec_path, json.dumps(spec.to_json(), indent=2) + "\n")
    tokenizer = load_tokenizer(spec.model)
    traces, paths = {}, {}
    for name, trace_spec in spec.trace_specs().items():
        paths[name] = path = root / "traces" / f"{name}.jsonl"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_trace(path, *generate_trace(trace_spec, tokenizer))
        traces[name] = read_trace(path)
    require_consent_for([t for trace in traces.values() for t in trace.trajectories])  # before any server starts
    lora_modules = {name: path for trace in traces.values() for name, path in (trace.header.adapters or {}).items()}
    model = resolve_model(spec.model)
    return SweepInputs(tokenizer, model, traces, lora_modules, paths, model_identity(model))


