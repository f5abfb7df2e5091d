"""`kvbench sweep`: a grid of replays (methods x contexts x QPS x agents x rounds x repeats) in one
directory, one server start per method configuration, resumable cell by cell.

Every experiment that runs servers and replays goes through `run_sweep`: `kvbench sweep`,
`kvbench paper --run` and the benchmark scripts (which add their own figures per cell with
`after_cell`, while the cell's server is still up).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbench import run_files
from kvbench.tracegen.generate import TraceSpec, task_roles

logger = logging.getLogger(__name__)

SWEEP_FILE = "sweep.json"
QUALITY_BASELINE = "quality-baseline"  # config.json's `sweep_role` of a sweep's reference and floor runs


@dataclass(frozen=True)
class MethodConfig:
    method: str
    params: dict[str, Any] = field(default_factory=dict)
    label: str | None = None  # the row's name in tables; derived from method and params by default

    @property
    def name(self) -> str:
        """Directory-safe name, e.g. `kvcmas` or `kvcmas-V10-tau0.3` (or the label)."""
        return self.label or self.method + "".join(f"-{k}{v}" for k, v in sorted(self.params.items()))


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


def run_sweep(spec: SweepSpec, root: Path, on_cell: Callable[[str], None] | None = None,
              after_cell: AfterCell | None = None) -> list[SweepCell]:
    """Run every cell not already complete; returns all cells. `after_cell` runs after each cell
    replayed now (not those done earlier), with the cell's server still up. Holds the folder's
    lock throughout (ResultDirError when another run holds it)."""
    from kvbench.replay.result_lock import result_dir_lock

    with result_dir_lock(root, on_note=logger.warning):  # one sweep per folder; each cell's replay locks its own
        return _run_sweep(spec, root, on_cell, after_cell)


@dataclass
class SweepInputs:
    """What every cell of a sweep reads: its traces (generated once into the folder), their
    tokenizer, the resolved model and the LoRA adapters the servers serve."""

    tokenizer: Any
    model: str
    traces: dict[str, Any]
    lora_modules: dict[str, str]

    def server_config(self, spec: SweepSpec, root: Path, method: MethodConfig) -> Any:
        """The server of one method configuration (its log in the configuration's folder)."""
        from kvbench.server.config import method_server_config

        return method_server_config(method.method, self.model, method.params, **spec.server_options,
                                    cpu_kv_cache_gib=spec.cpu_kv_cache_gib, lora_modules=self.lora_modules,
                                    log_path=root / "runs" / method.name / "server.log")


def prepare_sweep(spec: SweepSpec, root: Path) -> SweepInputs:
    """Record the sweep's spec in its folder (refusing another sweep's folder), generate its traces
    once, and check consent for model-written code before any server starts."""
    from kvbench.experiment.run import require_consent_for
    from kvbench.model.resolve import resolve_model
    from kvbench.tracegen.generate import generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer
    from kvbench.tracegen.trace_files import read_trace, write_trace

    spec_path = root / SWEEP_FILE
    if spec_path.exists() and not spec.extends(SweepSpec.from_json(json.loads(spec_path.read_text()))):
        raise ValueError(f"{root} holds a different sweep ({spec_path}); use another directory "
                         "(a sweep may only grow by methods)")
    run_files.write_text_atomic(spec_path, json.dumps(spec.to_json(), indent=2) + "\n")
    tokenizer = load_tokenizer(spec.model)
    traces = {}
    for name, trace_spec in spec.trace_specs().items():
        path = root / "traces" / f"{name}.jsonl"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_trace(path, *generate_trace(trace_spec, tokenizer))
        traces[name] = read_trace(path)
    require_consent_for([t for trace in traces.values() for t in trace.trajectories])  # before any server starts
    lora_modules = {name: path for trace in traces.values() for name, path in (trace.header.adapters or {}).items()}
    return SweepInputs(tokenizer, resolve_model(spec.model), traces, lora_modules)


def _run_sweep(spec: SweepSpec, root: Path, on_cell: Callable[[str], None] | None,
               after_cell: AfterCell | None) -> list[SweepCell]:
    from kvbench.server.lifecycle import wait_for_stopped_servers

    inputs = prepare_sweep(spec, root)
    cells = spec.cells(root)
    groups: list[tuple[MethodConfig, list[SweepCell]]] = [
        (method, list(group)) for method, group in itertools.groupby(cells, key=lambda cell: cell.method)]
    baselines = _quality_baselines_todo(spec, root, inputs.traces)
    if baselines:  # the references run on a plain NonShared server: its cells' first, on the same server
        groups.sort(key=lambda group: group[0] != PLAIN_NONSHARED)
        if not groups or groups[0][0] != PLAIN_NONSHARED:
            groups.insert(0, (PLAIN_NONSHARED, []))
    try:
        for index, (method, group) in enumerate(groups):
            todo = []
            for cell in group:
                if cell_done(cell.path):
                    if on_cell:
                        on_cell(f"{method.name} {cell.path.name} (done earlier)")
                else:
                    todo.append(cell)
            with_baselines = bool(baselines) and index == 0
            if not todo and not with_baselines:
                continue
            config = inputs.server_config(spec, root, method)
            if not todo:
                config.log_path = root / "quality" / "server.log"
            # One start per method configuration, while the previous one's server stops; that
            # one has exited before anything is measured.
            with sweep_servers(spec, config) as server:
                wait_for_stopped_servers()
                if with_baselines:
                    _run_quality_baselines(spec, root, inputs, baselines, server, on_cell)
                for cell in todo:
                    replay_cell(spec, root, cell, server, inputs.traces[cell.trace_id], inputs.tokenizer,
                                inputs.model, after_cell)
                    if on_cell:
                        on_cell(f"{method.name} {cell.path.name}")
    finally:
        wait_for_stopped_servers()  # no server outlives the sweep
    if spec.quality:
        compare_cells(root, cells)
    return cells


def replay_cell(spec: SweepSpec, root: Path, cell: SweepCell, server: Any, trace: Any, tokenizer: Any, model: str,
                after_cell: AfterCell | None = None) -> dict[str, Any] | None:
    """One cell's replay on its method's running server, resumed where an earlier one stopped;
    its summary, or None when the replay failed with the server still up (error.txt says why)."""
    from kvbench.experiment.run import replay_and_summarize
    from kvbench.replay.runner import ReplayConfig, ReplayError
    from kvbench.replay.sampling import SamplingParams
    from kvbench.replay.saturation import SaturationRule
    from kvbench.tracegen.schema import Trace

    method = cell.method
    config = ReplayConfig.build(
        trace=Trace(header=trace.header, trajectories=trace.trajectories[: spec.num_warmups + cell.num_trajectories]),
        tokenizer=tokenizer, method=method.method, base_urls=server.base_urls, result_dir=cell.path, routing=spec.routing,
        qps=cell.qps, seed=spec.seed + cell.repeat, num_warmups=spec.num_warmups,
        prime_method_state=spec.prime_method_state, save_prompt_ids=spec.save_prompt_ids,
        label=method.name, resume=(cell.path / run_files.CONFIG).exists(), method_params=method.params,
        request_timeout_s=spec.request_timeout_s, show_progress=False, logprobs=20 if spec.quality else 0,
        sampling=SamplingParams(temperature=spec.temperature), goodput=spec.goodput,
        saturation=SaturationRule() if spec.stop_on_saturation else None,
        server_pids=server.pids, server_failure=server.failure, server_tier_url=server.tier_url,
        metadata={"sweep_trace": cell.trace_id, "repeat": str(cell.repeat)},
        extra_config={"model": model, "method_params": method.params, "method_config": method.name,
                      "trace_path": str(root / "traces" / f"{cell.trace_id}.jsonl"),
                      "server_options": spec.server_options, "server_command": server.command(),
                      **server.describe()})
    try:
        summary = replay_and_summarize(config)
    except ReplayError as exc:
        if not server.is_running():
            raise
        (cell.path / "error.txt").write_text(str(exc) + "\n")
        return None
    if after_cell is not None:
        after_cell(cell, server, summary)
    return summary


def sweep_servers(spec: SweepSpec, config: Any) -> Any:
    """A method configuration's server (stopped in the background after it), or its
    `spec.instances` instances and their shared tier (stopped together after them)."""
    from kvbench.server.instances import InstancePlan, ServerGroup
    from kvbench.server.lifecycle import running_server

    if spec.instances == 1:
        return running_server(config)
    log_dir = config.log_path.parent if config.log_path is not None else Path(".")
    return ServerGroup(config, InstancePlan(instances=spec.instances, shared=spec.shared_tier), log_dir)


def _quality_baselines_todo(spec: SweepSpec, root: Path, traces: dict[str, Any]) -> list[tuple[str, Path, bool]]:
    """(trace, run folder, drop_shared) of the quality references and floors not yet done."""
    if not spec.quality:
        return []
    return [(name, run, drop) for name in traces for run, drop in zip(quality_dirs(root, name), (False, True))
            if not cell_done(run)]


def _run_quality_baselines(spec: SweepSpec, root: Path, inputs: SweepInputs, todo: list[tuple[str, Path, bool]],
                           server: Any, on_cell: Callable[[str], None] | None) -> None:
    """Per trace, on a plain NonShared server started with the sweep's server options (the flags
    its NonShared cells run with): the NonShared reference (with first-token logprobs) and the
    floor (every shared segment dropped), single stream, over the trace's measured trajectories."""
    from kvbench.experiment.run import replay_and_summarize
    from kvbench.replay.runner import ReplayConfig
    from kvbench.tracegen.schema import Trace

    for name, run, drop in todo:
        trace = inputs.traces[name]
        replay_and_summarize(ReplayConfig.build(
            trace=Trace(header=trace.header, trajectories=trace.trajectories), tokenizer=inputs.tokenizer,
            method="nonshared", base_urls=server.base_urls, result_dir=run, qps=0.0, seed=spec.seed, routing=spec.routing,
            num_warmups=spec.num_warmups, label="no-context" if drop else "reference", drop_shared=drop,
            logprobs=0 if drop else 20, resume=(run / run_files.CONFIG).exists(),
            request_timeout_s=spec.request_timeout_s, show_progress=False,
            server_pids=server.pids, server_failure=server.failure,
            extra_config={"model": inputs.model, "method_params": {}, "method_config": "nonshared",
                          "sweep_role": QUALITY_BASELINE,  # not a grid cell: tables leave it out
                          "server_command": server.command(),
                          "trace_path": str(root / "traces" / f"{name}.jsonl")}))
        if on_cell:
            on_cell(f"quality {'floor' if drop else 'reference'} {name}")


def compare_cells(root: Path, cells: list[SweepCell]) -> None:
    """Each finished cell against its trace's reference and floor (and FullShared's cell of the
    same trace, QPS and repeat as naive reuse), its summary rewritten with the quality keys."""
    from kvbench.analysis.quality import write_quality
    from kvbench.analysis.summary import write_summary

    fullshared = {(c.trace_id, c.qps, c.repeat): c.path for c in cells
                  if c.method.method == "fullshared" and not c.method.params and cell_done(c.path)}
    for cell in cells:
        reference, floor = quality_dirs(root, cell.trace_id)
        if not (cell_done(cell.path) and cell_done(reference) and cell_done(floor)):
            continue
        write_quality(cell.path, reference, floor, fullshared.get((cell.trace_id, cell.qps, cell.repeat)))
        write_summary(cell.path)
