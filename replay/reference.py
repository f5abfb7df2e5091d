"""A reference run for reference-anchored replay (`kvbench replay --reference RUN_DIR`): a
NonShared run of the same trace, whose recorded outputs the replay feeds to later turns in place
of its own. Every prompt is then token-identical to the reference's, and any difference in a
turn's output comes from its cache alone (per-hop attribution), not from drift upstream."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import run_files
from kvbench.model.store import model_identity
from kvbench.tracegen.schema import Trajectory
from kvbench.tracegen.trace_files import trajectory_digest


class ReferenceRunError(ValueError):
    """The reference run cannot anchor this replay (another trace, model or method, or outputs missing)."""


def trajectory_digests(trajectories: Sequence[Trajectory]) -> dict[str, str]:
    """Recorded in config.json: what a later run compares to know it replays the same content."""
    return {t.trajectory_id: trajectory_digest(t) for t in trajectories}


@dataclass(frozen=True)
class ReferenceRun:
    path: Path
    run_id: str
    outputs: dict[tuple[str, str], list[int]] = field(repr=False)

    def describe(self) -> dict[str, Any]:
        """config.json's `reference_run`."""
        return {"path": str(self.path), "run_id": self.run_id}


def _listed(items: Sequence[str], shown: int = 5) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _recorded_digests(run_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    recorded = config.get("trajectory_digests")
    if recorded is None:
        raise ReferenceRunError(f"{run_dir} does not record its trajectories' digests (a run made before kvbench "
                                "recorded them); replay it again")
    return recorded


def read_run_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / run_files.CONFIG
    if not path.exists():
        raise ReferenceRunError(f"{run_dir} is not a kvbench run (no {run_files.CONFIG})")
    return json.loads(path.read_text())


def recorded_model(config: dict[str, Any]) -> str | None:
    """A run's model identity: as recorded, else (runs before it was) from the path, if still there."""
    return config.get("model_identity") or model_identity(config.get("model"))


def check_same_content(run_dir: Path, config: dict[str, Any], trajectories: Sequence[Trajectory],
                       model: str | None) -> None:
    """Refuse a run of another trace (trajectory contents) or another model."""
    recorded = _recorded_digests(run_dir, config)
    differing = [t.trajectory_id for t in trajectories if recorded.get(t.trajectory_id) != trajectory_digest(t)]
    if differing:
        raise ReferenceRunError(f"{run_dir} replayed another trace: trajectories {_listed(differing)} are absent from it or "
                             "differ (another seed, shared length or output length?)")
    if model is not None and config.get("model") is not None and recorded_model(config) != model_identity(model):
        raise ReferenceRunError(f"{run_dir} ran model {config.get('model')!r}, this run {model!r}")


def read_outputs(run_dir: Path) -> dict[tuple[str, str], list[int]]:
    """(trajectory id, turn id) -> output token ids of a run's successful requests."""
    requests = pd.read_parquet(run_dir / run_files.REQUESTS, columns=["trajectory_id", "turn_id", "success",
                                                                      "output_token_ids"])
    ok = requests[requests["success"]]
    return {(str(r.trajectory_id), str(r.turn_id)): [int(i) for i in r.output_token_ids]
            for r in ok.itertuples(index=False)}


def load_reference(run_dir: Path, trajectories: Sequence[Trajectory], model: str | None) -> ReferenceRun:
    """The reference's outputs for every turn of `trajectories` (the ones this run measures)."""
    config = read_run_config(run_dir)
    if config.get("method") != "nonshared":
        raise ReferenceRunError(f"{run_dir} is a {config.get('method')!r} run; a reference must be a NonShared run "
                             "(dense prefill: the outputs every method is measured against)")
    if config.get("prompt_mode", "free") != "free":
        raise ReferenceRunError(f"{run_dir} was itself replayed in {config['prompt_mode']!r} mode; a reference "
                             "must run free")
    check_same_content(run_dir, config, trajectories, model)
    outputs = read_outputs(run_dir)
    missing = [f"{t.trajectory_id}/{turn.turn_id}" for t in trajectories for turn in t.turns
               if (t.trajectory_id, turn.turn_id) not in outputs]
    if missing:
        raise ReferenceRunError(f"{run_dir} has no successful output for {_listed(missing)}; finish it (--resume) or "
                             "replay fewer trajectories")
    return ReferenceRun(run_dir, str(config.get("run_id")), outputs)


def check_comparable(run_dir: Path, reference_dir: Path) -> None:
    """Refuse to compare a run's outputs with a reference of other content: the reference must be
    a free-running NonShared run of the same model whose trajectories have the same content as
    those the run recorded."""
    run, reference = read_run_config(run_dir), read_run_config(reference_dir)
    recorded = pd.read_parquet(run_dir / run_files.REQUESTS, columns=["trajectory_id"])["trajectory_id"]
    trajectory_ids = sorted(set(recorded))
    if reference.get("method") != "nonshared" or reference.get("prompt_mode", "free") != "free":
        raise ReferenceRunError(f"{reference_dir} is a {reference.get('method')!r} run in "
                                f"{reference.get('prompt_mode', 'free')!r} mode; a reference is a free-running "
                                "NonShared run")
    ours, theirs = _recorded_digests(run_dir, run), _recorded_digests(reference_dir, reference)
    differing = [t for t in trajectory_ids if theirs.get(t) != ours.get(t)]
    if differing:
        raise ReferenceRunError(f"{run_dir} and {reference_dir} replayed other traces: trajectories {_listed(differing)} "
                                "differ or are missing from the reference")
    if recorded_model(run) != recorded_model(reference):
        raise ReferenceRunError(f"{run_dir} ran model {run.get('model')!r}, {reference_dir} {reference.get('model')!r}")


# vLLM flags that change how a request is computed (kernels, batching, precision): a run and its
# reference that differ in one compare more than the method.
NUMERIC_FLAGS = ("--enforce-eager", "--dtype", "--tensor-parallel-size", "--kv-cache-dtype", "--max-num-seqs",
                 "--max-num-batched-tokens", "--seed", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                 "--no-enable-chunked-prefill")


def numeric_flags(command: list[str] | None) -> dict[str, str] | None:
    """The NUMERIC_FLAGS a recorded server command sets, with their values ("" for a switch);
    None when the run recorded no command (a server the user started)."""
    if not command:
        return None
    flags = {}
    for index, arg in enumerate(command):
        name, _, value = arg.partition("=")
        if name in NUMERIC_FLAGS:
            following = command[index + 1] if index + 1 < len(command) else ""
            flags[name] = value or ("" if following.startswith("--") or not following else following)
    return flags


def comparison_caveats(run: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """What differs between a run and its reference besides the method, from their config.json:
    server flags that change the computation, the vLLM version, and the load (QPS). Each is a
    warning, not a refusal: the comparison then includes that difference's own noise."""
    caveats = []
    ours, theirs = numeric_flags(run.get("server_command")), numeric_flags(reference.get("server_command"))
    if ours is not None and theirs is not None and ours != theirs:
        differing = sorted(set(ours.items()) ^ set(theirs.items()))
        caveats.append("its server flags differ from the reference's (" + ", ".join(
            f"{name}{'=' + value if value else ''}" for name, value in differing) + "): eager and compiled, or "
            "other batching or precision, give other outputs for the same prompt")
    if run.get("vllm_version") and reference.get("vllm_version") and run["vllm_version"] != reference["vllm_version"]:
        caveats.append(f"vLLM {run['vllm_version']} against the reference's {reference['vllm_version']}")
    rate, reference_rate = run.get("request_rate"), reference.get("request_rate")
    if rate is not None and reference_rate is not None and rate != reference_rate:
        caveats.append(f"it ran at QPS {rate:g}, the reference at {reference_rate:g}: batching under load changes "
                       "outputs by itself; a NonShared run at the same QPS shows that noise floor")
    return caveats
