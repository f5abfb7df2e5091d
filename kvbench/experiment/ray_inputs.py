"""What a sweep's cells need on a cluster worker, from the driver: the traces, the model and the
LoRA adapters, each checked by sha256 before a cell uses it.

- Traces travel as bytes (small). A worker writes them into its own scratch folder.
- An embedded model (`kvbench:...`, the default) is built or read from the worker's own kvbench
  install, then checked: its name and weights digest must be the driver's.
- A local model or adapter folder is used where it lies when the worker sees the same path with
  the same files (storage every node mounts), else copied from the driver through Ray's object
  store when it is at most SHIP_LIMIT_BYTES, else refused with what to do.
- Anything else (a hub name) is loaded by the worker's vLLM as on the driver.

Runs record the driver's model and trace paths (the sweep folder's analysis reads them there);
a cell's server loads the worker's copy."""

from __future__ import annotations

import dataclasses
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.experiment.file_bundle import (
    BundleError,
    FileBundle,
    folder_bytes,
    folder_digests,
    folder_files,
    place_folder,
)
from kvbench.experiment.sweep import SweepInputs, SweepSpec

SHIP_LIMIT_BYTES = 2 << 30  # a larger local folder must be on storage every node mounts at the same path


@dataclass(frozen=True)
class FolderInput:
    """A folder a cell needs (a local model or adapter): the driver's path, its files' digests and,
    when small enough, its bytes (an ObjectRef of a FileBundle; None: too large to send)."""

    path: str
    digests: dict[str, str]
    content: Any = None

    def place(self, cache: Path) -> str:
        """Where this folder is on this node: in place when the same files are at the driver's
        path, else the node's copy (written from `content` once per node)."""
        here = Path(self.path)
        if here.is_dir() and folder_digests(here) == self.digests:
            return self.path
        import ray

        bundle = ray.get(self.content) if self.content is not None else None
        try:
            return str(place_folder(self.digests, bundle, cache, self.path))
        except BundleError as exc:
            raise BundleError(f"node {platform.node()}: {exc}; put it on storage every node mounts at the same path "
                              "(or use a hub model name)") from None


@dataclass(frozen=True)
class ClusterInputs:
    """Everything the driver sends each cell task besides the cells themselves."""

    spec: SweepSpec
    traces: FileBundle  # traces/<id>.jsonl
    trace_paths: dict[str, str]  # the driver's, recorded by every run
    model: str  # the driver's resolved model, recorded by every run
    model_identity: str | None
    tokenizer_name: str
    model_folder: FolderInput | None  # a local model folder (not embedded, not a hub name)
    adapters: dict[str, FolderInput] = field(default_factory=dict)  # LoRA name -> its folder
    consent_env: dict[str, str] = field(default_factory=dict)  # e.g. consent to run model-written code
    # --protocol paper: the traces' reference runs (quality/<trace>/reference), done before the cells
    references: FileBundle | None = None


def cluster_inputs(spec: SweepSpec, inputs: SweepInputs) -> ClusterInputs:
    """The driver's side: its traces, model and adapters as a worker will check them."""
    import os

    from kvbench.tracegen.tasks.sandbox.code_execution import CONSENT_ENV

    trace_files = {f"traces/{name}.jsonl": path for name, path in inputs.trace_paths.items()}
    model_folder = (_folder_input(Path(inputs.model)) if not _embedded(spec) and Path(inputs.model).is_dir()
                    else None)
    return ClusterInputs(
        spec=spec, traces=FileBundle.of_files({name: Path(path) for name, path in trace_files.items()}),
        trace_paths={name: str(path) for name, path in inputs.trace_paths.items()}, model=inputs.model,
        model_identity=inputs.model_identity, tokenizer_name=inputs.tokenizer.name, model_folder=model_folder,
        adapters={name: _folder_input(Path(path)) for name, path in inputs.lora_modules.items()},
        consent_env={CONSENT_ENV: os.environ[CONSENT_ENV]} if os.environ.get(CONSENT_ENV) else {})


def with_references(inputs: ClusterInputs, root: Path, trace_ids: list[str]) -> ClusterInputs:
    """`inputs` carrying the finished reference runs of `trace_ids` from the driver's sweep folder
    `root` (under --protocol paper every cell's prompts are built on them)."""
    from kvbench.experiment.sweep import cell_done, quality_dirs

    runs = [run for run in (quality_dirs(root, trace)[0] for trace in trace_ids) if cell_done(run)]
    files = {path.relative_to(root).as_posix(): path for run in runs for path in folder_files(run)}
    return dataclasses.replace(inputs, references=FileBundle.of_files(files))


def _folder_input(folder: Path) -> FolderInput:
    import ray

    if folder_bytes(folder) > SHIP_LIMIT_BYTES:
        return FolderInput(str(folder), folder_digests(folder))
    bundle = FileBundle.of_folder(folder)  # its digests are the folder's: read and hashed once
    return FolderInput(str(folder), bundle.sha256, ray.put(bundle))


def _embedded(spec: SweepSpec) -> bool:
    from kvbench.model.store import EMBEDDED_PREFIX

    return spec.model is None or spec.model.startswith(EMBEDDED_PREFIX)


def place_inputs(inputs: ClusterInputs, scratch: Path) -> SweepInputs:
    """The worker's side: the traces written into `scratch`, the model and adapters found or
    placed and checked; what the cells read, recording the driver's paths."""
    import os

    from kvbench.model.resolve import resolve_model
    from kvbench.model.store import model_identity
    from kvbench.tracegen.tokenizer import load_tokenizer
    from kvbench.tracegen.trace_files import read_trace

    os.environ.update(inputs.consent_env)
    inputs.traces.write_into(scratch)
    if inputs.references is not None:  # where the cells look for them: quality/<trace>/reference
        inputs.references.write_into(scratch)
    traces = {name: read_trace(scratch / "traces" / f"{name}.jsonl") for name in inputs.trace_paths}
    cache = Path(tempfile.gettempdir()) / "kvbench-ray-inputs"
    spec = inputs.spec
    if inputs.model_folder is not None:
        served = inputs.model_folder.place(cache)
    elif _embedded(spec):
        served = resolve_model(spec.model)  # built or shipped with this node's kvbench
        if model_identity(served) != inputs.model_identity:
            raise BundleError(f"node {platform.node()}: {spec.model or 'the embedded model'} is "
                              f"{model_identity(served)} here, {inputs.model_identity} on the driver; "
                              "install the same kvbench on every node")
    else:
        assert spec.model is not None  # (None is the embedded default)
        served = spec.model  # a hub name: this node's vLLM loads it
    tokenizer = dataclasses.replace(load_tokenizer(served if inputs.model_folder is not None else spec.model),
                                    name=inputs.tokenizer_name)
    return SweepInputs(tokenizer=tokenizer, model=inputs.model, traces=traces,
                       lora_modules={name: folder.place(cache) for name, folder in inputs.adapters.items()},
                       trace_paths={name: Path(path) for name, path in inputs.trace_paths.items()},
                       model_identity=inputs.model_identity, served_model=served)
