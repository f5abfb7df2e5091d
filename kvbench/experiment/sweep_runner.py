"""Running a sweep (kvbench.experiment.sweep describes it): its cells by method configuration, one
server start per configuration (or its instances and their shared tier), its quality baselines,
then its cells, each a replay on that server. `run_sweep` runs the groups one after another here
(with `interleave`, side by side, their cells taking turns); kvbench.experiment.ray_sweep runs
each as a Ray task.

Every experiment that runs servers and replays goes through `run_sweep` (or `ray_sweep`):
`kvbench sweep`, `kvbench paper --run` and the benchmark scripts (which add their own figures per
cell with `after_cell`, while the cell's server is still up)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench import run_files
from kvbench.experiment.sweep import (
    PLAIN_NONSHARED,
    QUALITY_BASELINE,
    AfterCell,
    MethodConfig,
    SweepCell,
    SweepInputs,
    SweepSpec,
    cell_done,
    prepare_sweep,
    quality_dirs,
)
from kvbench.experiment.sweep_calibration import calibrated_params

logger = logging.getLogger(__name__)


@dataclass
class CellGroup:
    """One method configuration's share of a sweep: one server start, its cells not yet done and,
    on the plain NonShared configuration's server (run first), the quality baselines not yet done."""

    method: MethodConfig
    todo: list[SweepCell]
    done: list[SweepCell]
    baselines: list[tuple[str, Path, bool]] = field(default_factory=list)  # (trace, run folder, drop_shared)

    @property
    def idle(self) -> bool:
        return not self.todo and not self.baselines


def plan_groups(spec: SweepSpec, root: Path, trace_ids: list[str]) -> list[CellGroup]:
    """The sweep's cells by method configuration, in the order they run, with what is left of each."""
    cells = spec.cells(root)
    groups = [CellGroup(method, [c for c in group if not cell_done(c.path)], [c for c in group if cell_done(c.path)])
              for method, group in ((m, list(g)) for m, g in itertools.groupby(cells, key=lambda cell: cell.method))]
    baselines = _quality_baselines_todo(spec, root, trace_ids)
    if baselines:  # the references run on a plain NonShared server: its cells' first, on the same server
        groups.sort(key=lambda group: group.method != PLAIN_NONSHARED)
        if not groups or groups[0].method != PLAIN_NONSHARED:
            groups.insert(0, CellGroup(PLAIN_NONSHARED, [], []))
        groups[0].baselines = baselines
    return groups


def run_group(spec: SweepSpec, root: Path, inputs: SweepInputs, group: CellGroup,
              on_cell: Callable[[str], None] | None = None, after_cell: AfterCell | None = None) -> None:
    """Start the group's server (once) and run its baselines, then its cells, in `root`."""
    for step in group_steps(spec, root, inputs, group, after_cell):
        if step.finished and on_cell:
            on_cell(step.label)


@dataclass(frozen=True)
class GroupStep:
    """A run of a group about to start (finished=False) or just finished. `deferred`: a cell the
    group's caller replays (an interleaved sweep's single-stream round, its arms taking turns a
    trajectory at a time): its ReplayConfig, the group waiting until it is done."""

    run: Path
    label: str
    finished: bool
    deferred: Any = None


def group_steps(spec: SweepSpec, root: Path, inputs: SweepInputs, group: CellGroup,
                after_cell: AfterCell | None = None) -> Generator[GroupStep, None, None]:
    """The group's runs, one step before and one after each, on its server (started once, and
    stopped when the steps end or the iteration is given up)."""
    from kvbench.server.lifecycle import wait_for_stopped_servers

    config = inputs.server_config(spec, root, group.method)
    if not group.todo:
        config.log_path = root / "quality" / "server.log"
    # One start per method configuration, while the previous one's server stops; that one has
    # exited before anything is measured.
    with sweep_servers(spec, config) as server:
        wait_for_stopped_servers()
        for name, run, drop in group.baselines:
            label = f"quality {'floor' if drop else 'reference'} {name}"
            yield GroupStep(run, label, finished=False)
            _run_quality_baseline(spec, inputs, name, run, drop, server)
            yield GroupStep(run, label, finished=True)
        calibrated: dict[str, dict[str, Any]] = {}  # trace -> the parameters its cells run with
        for cell in group.todo:
            label = f"{group.method.name} {cell.path.name}"
            if cell.trace_id not in calibrated:  # --target-rho: the threshold set first, once per trace
                calibrated[cell.trace_id] = calibrated_params(spec, root, inputs, group.method, cell.trace_id, server)
            if spec.interleave and cell.qps == 0:
                yield GroupStep(cell.path, label, False, cell_config(spec, cell, server, inputs, calibrated[cell.trace_id]))
                if after_cell is not None and (cell.path / run_files.SUMMARY).exists():
                    after_cell(cell, server, json.loads((cell.path / run_files.SUMMARY).read_text()))
            else:
                yield GroupStep(cell.path, label, finished=False)
                replay_cell(spec, cell, server, inputs, after_cell, calibrated[cell.trace_id])
            yield GroupStep(cell.path, label, finished=True)


def replay_cell(spec: SweepSpec, cell: SweepCell, server: Any, inputs: SweepInputs,
                after_cell: AfterCell | None = None, params: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """One cell's replay on its method's running server, resumed where an earlier one stopped;
    its summary, or None when the replay failed with the server still up (error.txt says why).
    `params`: the method's parameters as the server runs them (calibrated: --target-rho)."""
    from kvbench.experiment.run import replay_and_summarize
    from kvbench.replay.runner import ReplayError

    config = cell_config(spec, cell, server, inputs, params)
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


def cell_config(spec: SweepSpec, cell: SweepCell, server: Any, inputs: SweepInputs,
                params: dict[str, Any] | None = None) -> Any:
    """The replay of one cell (a ReplayConfig) on its method's running server."""
    from kvbench.replay.protocol import protocol
    from kvbench.replay.runner import ReplayConfig
    from kvbench.replay.sampling import SamplingParams
    from kvbench.replay.saturation import SaturationRule
    from kvbench.tracegen.schema import Trace

    method, trace = cell.method, inputs.traces[cell.trace_id]
    params = dict(method.params) if params is None else params
    trajectories = trace.trajectories[: spec.num_warmups + cell.num_trajectories]
    chosen = protocol(spec.protocol)
    reference = None
    if chosen.anchored:  # every prompt on the reference's outputs (run first, on the NonShared server)
        from kvbench.replay.reference import load_reference

        root = root_of(cell)
        reference = load_reference(quality_dirs(root, cell.trace_id)[0], trajectories[spec.num_warmups:], inputs.model)
        if inputs.recorded_root is not None:  # a cluster worker's copy: recorded where the driver keeps it
            reference = dataclasses.replace(reference, path=inputs.recorded_root / reference.path.relative_to(root))
    return ReplayConfig.build(
        trace=Trace(header=trace.header, trajectories=trajectories), reference=reference,
        first_token_only=chosen.first_token_only,
        tokenizer=inputs.tokenizer, method=method.chosen.with_params(params), base_urls=server.base_urls, result_dir=cell.path,
        routing=spec.routing, qps=cell.qps, seed=spec.seed + cell.repeat, num_warmups=spec.num_warmups,
        prime_method_state=spec.prime_method_state, save_prompt_ids=spec.save_prompt_ids,
        label=method.name, resume=(cell.path / run_files.CONFIG).exists(),
        request_timeout_s=spec.request_timeout_s, show_progress=False, logprobs=20 if spec.quality else 0,
        sampling=SamplingParams(temperature=spec.temperature), goodput=spec.goodput,
        saturation=SaturationRule() if spec.stop_on_saturation else None,
        server_pids=server.pids, server_failure=server.failure, server_tier_url=server.tier_url,
        metadata={"sweep_trace": cell.trace_id, "repeat": str(cell.repeat)},
        extra_config={**inputs.recorded(cell.trace_id), **_comparison(spec, cell),
                      "method_params": params, "method_config": method.name,
                      "target_rho": method.target_rho,
                      "server_options": spec.server_options, "server_command": server.command(),
                      **server.describe()})


def _comparison(spec: SweepSpec, cell: SweepCell) -> dict[str, Any]:
    """An interleaved sweep's cell is an arm of its (trace, QPS, repeat)'s comparison: a report
    pairs it with that repeat's NonShared cell only. The id is the sweep folder's own (written once,
    kept on resume), so two sweeps' cells never pair."""
    if not spec.interleave:
        return {}
    root = root_of(cell)
    id_file = root / "comparison-id"
    if not id_file.exists():
        import uuid

        run_files.write_text_atomic(id_file, uuid.uuid4().hex[:12] + "\n")
    sweep_id = id_file.read_text().strip()
    return {run_files.COMPARISON: {"id": f"{sweep_id}-{cell.trace_id}-qps{cell.qps:g}-rep{cell.repeat}",
                                   "arms": [m.name for m in spec.methods], "interleaved": True,
                                   # single stream: turns a trajectory at a time; under load, a cell at a time
                                   "unit": "trajectory" if cell.qps == 0 else "cell"}}


def sweep_servers(spec: SweepSpec, config: Any) -> Any:
    """A method configuration's server (stopped in the background after it), or its
    `spec.instances` instances and their shared tier (stopped together after them)."""
    from kvbench.server.instances import InstancePlan, ServerGroup
    from kvbench.server.lifecycle import running_server

    if spec.instances == 1:
        return running_server(config)
    log_dir = config.log_path.parent if config.log_path is not None else Path(".")
    return ServerGroup(config, InstancePlan(instances=spec.instances, shared=spec.shared_tier), log_dir)


def _quality_baselines_todo(spec: SweepSpec, root: Path, trace_ids: list[str]) -> list[tuple[str, Path, bool]]:
    """(trace, run folder, drop_shared) of the quality references and floors not yet done: both
    with --quality, the reference alone under a protocol whose prompts carry its outputs."""
    from kvbench.replay.protocol import protocol

    kinds = (False, True) if spec.quality else (False,) if protocol(spec.protocol).anchored else ()
    return [(name, run, drop) for name in trace_ids for run, drop in zip(quality_dirs(root, name), (False, True))
            if drop in kinds and not cell_done(run)]


def root_of(cell: SweepCell) -> Path:
    """The sweep folder a cell's run folder is in (cell_dir: ROOT/runs/METHOD/RUN)."""
    return cell.path.parents[2]


def _run_quality_baseline(spec: SweepSpec, inputs: SweepInputs, name: str, run: Path, drop: bool, server: Any) -> None:
    """On a plain NonShared server started with the sweep's server options (the flags its
    NonShared cells run with): trace `name`'s NonShared reference (with first-token logprobs) or
    its floor (`drop`: every shared segment dropped), single stream, over its measured trajectories."""
    from kvbench.experiment.run import replay_and_summarize
    from kvbench.replay.runner import ReplayConfig
    from kvbench.tracegen.schema import Trace

    trace = inputs.traces[name]
    replay_and_summarize(ReplayConfig.build(
        trace=Trace(header=trace.header, trajectories=trace.trajectories), tokenizer=inputs.tokenizer,
        method=PLAIN_NONSHARED.chosen, base_urls=server.base_urls, result_dir=run, qps=0.0, seed=spec.seed, routing=spec.routing,
        num_warmups=spec.num_warmups, label="no-context" if drop else "reference", drop_shared=drop,
        logprobs=0 if drop else 20, resume=(run / run_files.CONFIG).exists(), save_prompt_ids=spec.save_prompt_ids,
        request_timeout_s=spec.request_timeout_s, show_progress=False,
        server_pids=server.pids, server_failure=server.failure,
        extra_config={**inputs.recorded(name), "method_params": {}, "method_config": "nonshared",
                      "sweep_role": QUALITY_BASELINE,  # not a grid cell: tables leave it out
                      "server_command": server.command()}))


def run_sweep(spec: SweepSpec, root: Path, on_cell: Callable[[str], None] | None = None,
              after_cell: AfterCell | None = None) -> list[SweepCell]:
    """Run every cell not already complete; returns all cells. `after_cell` runs after each cell
    replayed now (not those done earlier), with the cell's server still up. Holds the folder's
    lock throughout (ResultDirError when another run holds it)."""
    from kvbench.replay.result_lock import result_dir_lock

    with result_dir_lock(root, on_note=logger.warning):  # one sweep per folder; each cell's replay locks its own
        return _run_sweep(spec, root, on_cell, after_cell)


def _run_sweep(spec: SweepSpec, root: Path, on_cell: Callable[[str], None] | None,
               after_cell: AfterCell | None) -> list[SweepCell]:
    from kvbench.server.lifecycle import wait_for_stopped_servers

    inputs = prepare_sweep(spec, root)
    try:
        groups = plan_groups(spec, root, list(inputs.traces))
        for group in groups:
            if on_cell:
                for cell in group.done:
                    on_cell(f"{group.method.name} {cell.path.name} (done earlier)")
        if spec.interleave:
            run_groups_interleaved(spec, root, inputs, [g for g in groups if not g.idle], on_cell, after_cell)
        else:
            for group in groups:
                if not group.idle:
                    run_group(spec, root, inputs, group, on_cell, after_cell)
    finally:
        wait_for_stopped_servers()  # no server outlives the sweep
    return finish_sweep(spec, root)


def interleave_shortfall(spec: SweepSpec) -> str | None:
    """Why the servers an interleaved sweep keeps up together (each method configuration's, and the
    plain NonShared one its quality baselines run on, each on its instances) do not fit in this
    machine's memory, or None."""
    from kvbench.experiment.interleaved import side_by_side_shortfall, weights_bytes
    from kvbench.model.resolve import resolve_model

    configurations = {m.name for m in spec.methods} | ({PLAIN_NONSHARED.name} if spec.quality else set())
    return side_by_side_shortfall(len(configurations) * spec.instances, spec.cpu_kv_cache_gib,
                                  weights_bytes(resolve_model(spec.model)))


def run_groups_interleaved(spec: SweepSpec, root: Path, inputs: SweepInputs, groups: list[CellGroup],
                           on_cell: Callable[[str], None] | None = None, after_cell: AfterCell | None = None) -> None:
    """Every group's server up side by side (each started at its first turn, none stopped before
    the last cell); the groups take turns a cell each, the order rotating every round, so cell k of
    every method runs back to back. A round of single-stream cells (QPS 0) is one interleaved
    comparison, its arms taking turns a trajectory at a time (kvbench.experiment.interleaved).
    Quality baselines run at once, outside the turns."""
    import contextlib

    from kvbench.experiment.interleaved import Arm, replay_interleaved

    quality = root / "quality"

    def start(steps: Iterator[GroupStep]) -> GroupStep | None:
        """The group's next cell started (a baseline run through first), or None: none left."""
        while (step := next(steps, None)) is not None:
            if step.deferred is not None or not step.run.is_relative_to(quality):
                return step
            finish(steps)
        return None

    def finish(steps: Iterator[GroupStep]) -> None:
        finished = next(steps)
        if on_cell:
            on_cell(finished.label)

    with contextlib.ExitStack() as stack:
        turns: list[Iterator[GroupStep]] = []
        for group in groups:
            generator = group_steps(spec, root, inputs, group, after_cell)
            stack.callback(generator.close)  # its server stops when the sweep does
            turns.append(generator)
        round_index = 0
        while turns:
            offset = round_index % len(turns)
            deferred: list[tuple[Iterator[GroupStep], GroupStep]] = []
            for steps in turns[offset:] + turns[:offset]:
                step = start(steps)
                if step is None:
                    turns.remove(steps)
                elif step.deferred is not None:
                    deferred.append((steps, step))  # replayed below, with the round's others
                else:
                    finish(steps)
            if deferred:
                try:
                    replay_interleaved([Arm(step.deferred) for _, step in deferred], on_note=logger.warning)
                finally:
                    for steps, _ in deferred:
                        finish(steps)
            round_index += 1


def finish_sweep(spec: SweepSpec, root: Path) -> list[SweepCell]:
    """After the cells: each compared with its trace's quality baselines (with --quality); all cells."""
    cells = spec.cells(root)
    if spec.quality:
        compare_cells(root, cells)
    return cells


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
