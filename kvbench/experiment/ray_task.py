"""One method configuration's share of a sweep on a Ray worker: its inputs placed and checked,
its server started once, its runs made in a scratch folder of the worker's, and each finished run
folder sent back to the driver (kvbench.experiment.ray_sweep) as it finishes, with the server's
log at the end, also when the task fails. The scratch folder is removed however the task ends."""

from __future__ import annotations

import platform
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from kvbench import __version__
from kvbench.contracts import CellTaskEvent
from kvbench.experiment.file_bundle import FileBundle
from kvbench.experiment.ray_inputs import ClusterInputs, place_inputs
from kvbench.experiment.sweep import AfterCell
from kvbench.experiment.sweep_runner import CellGroup, group_steps


def rebased(group: CellGroup, root: Path, scratch: Path) -> CellGroup:
    """The group's run folders moved from the sweep folder `root` to `scratch`."""
    def move(path: Path) -> Path:
        return scratch / path.relative_to(root)

    return CellGroup(group.method, [replace(cell, path=move(cell.path)) for cell in group.todo], [],
                     [(name, move(run), drop) for name, run, drop in group.baselines])


def run_cell_group(inputs: ClusterInputs, group: CellGroup, root: str,
                   after_cell: AfterCell | None = None) -> Iterator[CellTaskEvent]:
    """The Ray task's body (a generator: Ray streams each event to the driver as it is yielded).
    `group`'s paths are the driver's sweep folder `root`'s."""
    from kvbench.replay.run_config import git_sha

    node, started = platform.node(), time.time()
    scratch = Path(tempfile.mkdtemp(prefix="kvbench-cells-"))
    log = None
    try:
        cells = replace(place_inputs(inputs, scratch), recorded_root=Path(root))  # runs name the driver's folder
        local = rebased(group, Path(root), scratch)
        log = scratch / ("runs/" + group.method.name if local.todo else "quality") / "server.log"
        yield CellTaskEvent("started", node, time.time(), detail={
            "kvbench_version": __version__, "git_sha": git_sha(), "entered_at": started, "inputs_s": time.time() - started})
        for step in group_steps(inputs.spec, scratch, cells, local, after_cell):
            run = step.run.relative_to(scratch).as_posix()
            if not step.finished:
                yield CellTaskEvent("cell_started", node, time.time(), run=run)
                began = time.time()
                continue
            bundle = FileBundle.of_folder(step.run)  # named inside the run folder
            yield CellTaskEvent("cell_finished", node, time.time(), run=run, files=bundle.files, sha256=bundle.sha256,
                                detail={"run_s": time.time() - began})
    except Exception:
        if log is not None and log.is_file():  # why the server failed, for the driver's folder
            yield _log_event(node, log, scratch)
        raise
    else:
        if log is not None and log.is_file():
            yield _log_event(node, log, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _log_event(node: str, log: Path, scratch: Path) -> CellTaskEvent:
    bundle = FileBundle.of_files({log.relative_to(scratch).as_posix(): log})
    return CellTaskEvent("log", node, time.time(), files=bundle.files, sha256=bundle.sha256)
