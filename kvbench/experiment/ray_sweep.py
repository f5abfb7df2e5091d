"""`kvbench sweep --ray [ADDRESS]`: a sweep's groups of cells (one server configuration and its
runs, kvbench.experiment.sweep_runner) as Ray tasks, in parallel as the cluster's resources allow.

The driver keeps the sweep folder: it prepares the sweep as a local one does, sends each task its
inputs (kvbench.experiment.ray_inputs), and commits each run folder a task sends back, whole and
checked, as it arrives (kvbench.experiment.ray_task). Workers need not share its filesystem. A task
that fails (its worker killed, its server dead) is submitted again for the runs it had not
finished, up to `max_retries` times; then those runs are recorded as failed, with the reason, in
their folders' error.txt and in ray_cells.jsonl, and the sweep ends with an error naming them. A
rerun of the same command runs only what is not done. ray_cells.jsonl also says where each run
ran and what Ray added to it (task start, transfer, commit)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.contracts import CellTaskEvent
from kvbench.experiment.file_bundle import FileBundle, commit_folder
from kvbench.experiment.sweep import AfterCell, SweepCell, SweepSpec, cell_done, prepare_sweep, quality_dirs
from kvbench.experiment.sweep_runner import CellGroup, finish_sweep, plan_groups

RAY_CELLS_FILE = "ray_cells.jsonl"
WORKER_SETUP_ENV = "KVBENCH_RAY_WORKER_SETUP"  # module.function each worker runs first (Ray's setup hook)
CANCEL_GRACE_S = 30.0  # how long cancelled tasks get to stop their servers before they are killed
LOCAL = "local"  # `--ray` without an address: a Ray started on this machine for the sweep


class RaySweepError(RuntimeError):
    """Ray is missing or unreachable, or the cluster cannot run a cell."""


class SweepRunsFailed(RuntimeError):
    """Runs whose tasks failed on every attempt (the others are committed)."""


@dataclass(frozen=True)
class RayOptions:
    address: str = LOCAL  # `auto`, a head's HOST:PORT or `ray://HOST:PORT`; LOCAL: start one here
    max_retries: int = 1
    cell_cpus: float | None = None  # default: a whole node's cores on CPU, 1 beside GPUs
    cell_gpus: float | None = None  # default: the cell's tensor-parallel size x instances, where GPUs exist
    cell_memory_gib: float | None = None  # default on CPU: the KV cache x instances + 2 GiB


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RaySweepError("--ray needs Ray: pip install 'kvbench[ray]' (scripts/install.sh installs it)") from None
    return ray


CONNECT_TIMEOUT_S = 10.0


def unreachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why nothing answers at a cluster's HOST:PORT (or ray://HOST:PORT), within `timeout_s`; None
    when something does, or the address names no port (`auto`: Ray finds the cluster itself)."""
    import socket

    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"nothing answers at {host}:{port} within {timeout_s:g} s ({exc.strerror or exc})"


@contextlib.contextmanager
def ray_session(address: str) -> Iterator[Any]:
    """Ray connected (or started here, and stopped after), each worker set up as this process asks:
    its KVBENCH_* environment, and the setup hook named by KVBENCH_RAY_WORKER_SETUP."""
    ray = import_ray()
    env = {key: value for key, value in os.environ.items() if key.startswith("KVBENCH_")}
    runtime_env: dict[str, Any] = {"env_vars": env}
    if hook := os.environ.get(WORKER_SETUP_ENV):
        runtime_env["worker_process_setup_hook"] = hook
    kwargs: dict[str, Any] = {"runtime_env": runtime_env, "log_to_driver": False, "logging_level": "ERROR"}
    if address == LOCAL:
        kwargs["include_dashboard"] = False
    else:
        kwargs["address"] = address
        if (problem := unreachable(address)) is not None:  # Ray itself retries for many minutes, silently
            raise RaySweepError(f"cannot connect to Ray at {address}: {problem}; start the cluster there "
                                "(`ray start --head`) or give its address")
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RaySweepError(f"cannot connect to Ray at {address}: {exc}") from None
    try:
        yield ray
    finally:
        ray.shutdown()  # stops a Ray started here; disconnects from a cluster


def cell_resources(spec: SweepSpec, options: RayOptions, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """What one cell task asks Ray for, refused when no node of the cluster has it."""
    from kvbench.server.config import tensor_parallel_size

    alive = [node["Resources"] for node in nodes if node.get("Alive", True)]
    devices = tensor_parallel_size(list(spec.server_options.get("extra_args", []))) * spec.instances
    gpus = options.cell_gpus if options.cell_gpus is not None else (devices if any(r.get("GPU") for r in alive) else 0)
    if gpus:
        cpus, memory_gib = options.cell_cpus or 1, options.cell_memory_gib
    else:  # vLLM's CPU backend uses every core it is given: one cell per node unless told otherwise
        cpus = options.cell_cpus or min((r.get("CPU", 1) for r in alive), default=1)
        memory_gib = (options.cell_memory_gib if options.cell_memory_gib is not None
                      else spec.cpu_kv_cache_gib * spec.instances + 2)
    memory = int(memory_gib * 2**30) if memory_gib else 0
    if not any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus and r.get("memory", 0) >= memory for r in alive):
        raise RaySweepError(f"no node of the Ray cluster has {cpus:g} CPUs, {gpus:g} GPUs and {memory / 2**30:.1f} GiB "
                            "of memory for a cell; set --cell-cpus, --cell-gpus or --cell-memory-gib")
    return {"num_cpus": cpus, "num_gpus": gpus, **({"memory": memory} if memory else {})}


@dataclass
class _Task:
    """One group's current attempt."""

    group: CellGroup
    attempt: int
    submitted: float
    generator: Any = None
    node: str = "?"
    started: float | None = None  # the task's start on its worker (the worker's clock)
    inputs_s: float | None = None  # placing its inputs there
    committed: set[str] = field(default_factory=set)


def run_sweep_on_ray(spec: SweepSpec, root: Path, options: RayOptions, on_line: Callable[[str], None],
                     after_cell: AfterCell | None = None) -> list[SweepCell]:
    """The sweep in `root` with its groups as Ray tasks; all its cells. SweepRunsFailed after
    committing everything else when runs failed on every attempt."""
    from kvbench.experiment.ray_inputs import cluster_inputs, with_references
    from kvbench.experiment.ray_task import run_cell_group
    from kvbench.replay.protocol import protocol
    from kvbench.replay.result_lock import result_dir_lock

    with result_dir_lock(root):  # one sweep per folder
        inputs = prepare_sweep(spec, root)
        groups = plan_groups(spec, root, list(inputs.traces))
        for group in groups:
            for cell in group.done:
                on_line(f"{group.method.name} {cell.path.name}: done earlier")
        todo = [group for group in groups if not group.idle]
        failed: list[str] = []
        if todo:
            began = time.monotonic()
            with ray_session(options.address) as ray:
                on_line(("a local Ray started" if options.address == LOCAL else f"connected to Ray at {options.address}")
                        + f" in {time.monotonic() - began:.1f} s; {sum(len(g.todo) + len(g.baselines) for g in todo)} "
                        f"run(s) in {len(todo)} task(s)")
                resources = cell_resources(spec, options, ray.nodes())
                shipped = cluster_inputs(spec, inputs)
                remote = ray.remote(max_retries=0)(run_cell_group).options(**resources)

                def submit(group: CellGroup, attempt: int) -> _Task:
                    task = _Task(group, attempt, time.time())
                    task.generator = remote.remote(shipped, group, str(root), after_cell)
                    return task

                # Under --protocol paper every cell's prompts are built on its trace's reference run:
                # the group running the references goes first, and the rest carry them.
                anchored = protocol(spec.protocol).anchored
                first = [group for group in todo if anchored and group.baselines]
                failed = _drive(ray, [submit(group, 1) for group in first], submit, root, options, on_line)
                rest = [group for group in todo if not (anchored and group.baselines)]
                missing = [trace for trace in inputs.traces if anchored and not cell_done(quality_dirs(root, trace)[0])]
                if missing and rest:
                    raise SweepRunsFailed(f"the reference run(s) of {', '.join(missing)} failed on every attempt; the "
                                          f"other {sum(len(g.todo) for g in rest)} run(s) replay on them and were not "
                                          f"started (reasons in their error.txt); rerun the same command")
                if anchored:
                    shipped = with_references(shipped, root, list(inputs.traces))
                failed += _drive(ray, [submit(group, 1) for group in rest], submit, root, options, on_line)
        cells = finish_sweep(spec, root)
    if failed:
        raise SweepRunsFailed(f"{len(failed)} run(s) failed on every attempt: {', '.join(failed)} (reasons in their "
                              f"error.txt and {root / RAY_CELLS_FILE}); rerun the same command to retry them")
    return cells


def _drive(ray: Any, tasks: list[_Task], submit: Callable[[CellGroup, int], _Task], root: Path,
           options: RayOptions, on_line: Callable[[str], None]) -> list[str]:
    """Commit what the tasks send until all have ended; resubmit failed ones. The runs that failed."""
    from kvbench.replay.interrupts import Interrupted, on_stop_signals

    live = {id(task.generator): task for task in tasks}
    failed: list[str] = []
    signals: list[int] = []  # taken between Ray's calls: raised inside one, they leave it broken
    with on_stop_signals(signals.append):
        try:
            _commit_until_done(ray, live, submit, root, options, on_line, failed, signals)
        except BaseException:
            _cancel(ray, [task.generator for task in live.values()], signals)
            raise
        if signals:  # (a signal while the tasks were ending)
            raise Interrupted(signals[0])
    return failed


def _commit_until_done(ray: Any, live: dict[int, _Task], submit: Callable[[CellGroup, int], _Task], root: Path,
                       options: RayOptions, on_line: Callable[[str], None], failed: list[str], signals: list[int]) -> None:
    from kvbench.replay.interrupts import Interrupted

    while live:
        if signals:
            raise Interrupted(signals[0])
        ready, _ = ray.wait([task.generator for task in live.values()], num_returns=1, timeout=1.0)
        for generator in ready:
            task = live[id(generator)]
            try:
                event = ray.get(next(generator)).checked()
            except StopIteration:
                del live[id(generator)]
                continue
            except ray.exceptions.RayError as exc:  # the task failed: its worker, its server, or a cell's error
                del live[id(generator)]
                retry = _failed(task, _reason(exc), root, options, on_line, failed)
                if retry is not None:
                    new = submit(retry, task.attempt + 1)
                    live[id(new.generator)] = new
                continue
            _handle(event, task, root, on_line)


def _handle(event: CellTaskEvent, task: _Task, root: Path, on_line: Callable[[str], None]) -> None:
    task.node = event.node
    if event.kind == "started":
        task.started, task.inputs_s = event.detail.get("entered_at", event.at), event.detail.get("inputs_s")
        _same_kvbench(event)
    elif event.kind == "cell_started":
        assert event.run is not None
        on_line(f"{_label(event.run)}: started on {event.node}" + (f" (attempt {task.attempt})" if task.attempt > 1 else ""))
    elif event.kind == "cell_finished":
        assert event.run is not None
        received = time.time()
        bundle = FileBundle(event.files, event.sha256)
        commit_folder(bundle, root / event.run)
        committed = time.time()
        task.committed.add(event.run)
        _record(root, {
            "run": event.run, "node": event.node, "attempt": task.attempt, "outcome": "finished",
            # submission to the task's start on its worker (with any wait for a free node)
            "task_start_s": (task.started or event.at) - task.submitted, "inputs_s": task.inputs_s,
            "run_s": event.detail.get("run_s"), "transfer_s": received - event.at, "commit_s": committed - received,
            "bytes": bundle.total_bytes, "files": len(bundle.files)})
        on_line(f"{_label(event.run)}: finished on {event.node} in {event.detail.get('run_s', 0):.1f} s "
                f"({len(bundle.files)} files, {bundle.total_bytes / 1e6:.1f} MB committed in {committed - event.at:.2f} s)")
    elif event.kind == "log":  # the server's log, appended as a local sweep's reruns append theirs
        for name, data in FileBundle(event.files, event.sha256).verified().files.items():
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "ab") as handle:
                handle.write(data)


def _failed(task: _Task, reason: str, root: Path, options: RayOptions, on_line: Callable[[str], None],
            failed: list[str]) -> CellGroup | None:
    """The group left to retry after `task` failed, or None (recorded as failed, or nothing left)."""
    group = task.group
    left = CellGroup(group.method, [c for c in group.todo if _relative(c.path, root) not in task.committed], [],
                     [b for b in group.baselines if _relative(b[1], root) not in task.committed])
    if left.idle:
        return None
    where = f"on {task.node}" if task.node != "?" else "before it started"
    if task.attempt <= options.max_retries:
        on_line(f"{group.method.name}: task failed {where} ({reason}); retrying its {len(left.todo) + len(left.baselines)} "
                f"unfinished run(s) ({task.attempt} of {options.max_retries})")
        return left
    for run in [c.path for c in left.todo] + [b[1] for b in left.baselines]:
        name = _relative(run, root)
        run.mkdir(parents=True, exist_ok=True)
        (run / "error.txt").write_text(f"its Ray task failed {where} on each of {task.attempt} attempt(s); the last: "
                                       f"{reason}\n")
        _record(root, {"run": name, "node": task.node, "attempt": task.attempt, "outcome": "failed", "reason": reason})
        on_line(f"{_label(name)}: failed {where} after {task.attempt} attempt(s): {reason}")
        failed.append(name)
    return None


def _cancel(ray: Any, generators: list[Any], signals: list[int]) -> None:
    """Stop the tasks still running: each first asked (its server stopped by its own context
    managers), then killed after CANCEL_GRACE_S or a second stop signal (a killed worker's server
    gets SIGTERM too)."""
    asked = len(signals)
    for generator in generators:
        with contextlib.suppress(Exception):
            ray.cancel(generator)
    deadline = time.monotonic() + CANCEL_GRACE_S
    pending = list(generators)
    while pending and time.monotonic() < deadline and len(signals) <= asked:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        for generator in ready:
            with contextlib.suppress(Exception):
                for ref in generator:  # drained: the task has ended
                    with contextlib.suppress(Exception):
                        ray.get(ref)
    for generator in pending:
        with contextlib.suppress(Exception):
            ray.cancel(generator, force=True)


def _same_kvbench(event: CellTaskEvent) -> None:
    from kvbench import __version__
    from kvbench.replay.run_config import git_sha

    theirs = (event.detail.get("kvbench_version"), event.detail.get("git_sha"))
    if theirs != (__version__, git_sha()):
        raise RaySweepError(f"node {event.node} runs kvbench {theirs[0]} at {theirs[1]}, this driver {__version__} at "
                            f"{git_sha()}; install the same kvbench on every node")


def _reason(exc: BaseException) -> str:
    """The failure in one line: the worker's own exception where there is one."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _label(run: str) -> str:
    """`runs/fullshared/ctx64-...` -> `fullshared ctx64-...`; `quality/T/reference` as it is."""
    parts = run.split("/")
    return " ".join(parts[1:]) if parts[0] == "runs" else run


def _record(root: Path, record: dict[str, Any]) -> None:
    with open(root / RAY_CELLS_FILE, "a") as handle:
        handle.write(json.dumps(record) + "\n")

