"""The paper's cache-fidelity measurements (`kvbench paper fig2|fig3|table2|fig7 --run`), taken
inside the vLLM workers of a sweep's cells while their servers are up, on the trace's real shared
segments (kvbench.analysis.paper.fidelity renders them):

- in FullShared's cells, every shared segment of every measured turn of NonShared's cell is
  prefilled densely in the turn's prompt and in its source turn's cache, and the two are compared
  in the worker (WorkerRpc.SEGMENT_FIDELITY: spectra of base and correction, reuse error, token
  criteria);
- in every connector method's cells, each measured turn's saved cache (what the method served,
  corrected or not) is compared with a dense prefill of the same prompt, segment by segment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import run_files
from kvbench.experiment.sweep import AfterCell, MethodConfig, SweepCell
from kvbench.replay.prompts import PromptBuilder, TurnPrompt
from kvbench.tracegen.schema import Trajectory

RECOMPUTE_BUDGET = 0.1  # Table 2's budget: the paper's operating point rho = 0.9 for LLM workloads
QUERY_TAIL = 10  # RelayCaching's suffix_tokens: the prompt rows whose attention ranks tokens


@dataclass(frozen=True)
class TurnSpans:
    trajectory: Trajectory
    turn_index: int
    prompt: TurnPrompt


def replayed_prompts(trajectories: list[Trajectory], outputs: dict[tuple[str, str], list[int]],
                     builder: PromptBuilder) -> dict[tuple[str, str], TurnSpans]:
    """Every turn's prompt as the run built it, rebuilt from the trace and the run's own outputs
    (the prompt builder is deterministic), with its segments' spans and sources."""
    turns = {}
    for trajectory in trajectories:
        prompts: dict[str, TurnPrompt] = {}
        finished: dict[str, list[int]] = {}
        for index, turn in enumerate(trajectory.turns):
            if (trajectory.trajectory_id, turn.turn_id) not in outputs:
                break  # a failed turn: the ones after it never ran as recorded
            prompt = builder.build(trajectory, turn, finished, prompts)
            prompts[turn.turn_id] = prompt
            finished[turn.turn_id] = outputs[(trajectory.trajectory_id, turn.turn_id)]
            turns[(trajectory.trajectory_id, turn.turn_id)] = TurnSpans(trajectory, index, prompt)
    return turns


def _measured(requests: pd.DataFrame, trajectories: int | None) -> pd.DataFrame:
    ok = requests[requests["success"]]
    kept = sorted(set(ok["trajectory_id"]))
    return ok[ok["trajectory_id"].isin(kept[-trajectories:] if trajectories else kept)]


def _check_prompt(row: Any, prompt: TurnPrompt) -> None:
    recorded = getattr(row, "prompt_token_ids", None)
    if recorded is not None and [int(t) for t in recorded] != prompt.token_ids:
        raise RuntimeError(f"turn {row.trajectory_id}/{row.turn_id}: the rebuilt prompt differs from the one the run "
                           "sent (another trace file or tokenizer?)")


def _segment_rows(client: Any, turn: TurnSpans, row: Any, outputs: dict[tuple[str, str], list[int]],
                  turns: dict[tuple[str, str], TurnSpans], check_layer: int, budget: float,
                  context: int) -> list[dict[str, Any]]:
    from kvbench.contracts import FidelityRequest

    rows = []
    first_ph = True
    for segment in turn.prompt.plan.segments:
        if segment.kind != "ph":
            continue
        preceded_by = "pf" if first_ph else "ph"
        first_ph = False
        if not segment.source_turn or segment.source_start is None:
            continue  # nothing to reuse it from (the first agent's query)
        source = turns[(turn.trajectory.trajectory_id, segment.source_turn)]
        source_tokens = source.prompt.token_ids + outputs[(turn.trajectory.trajectory_id, segment.source_turn)]
        request = FidelityRequest(
            target_tokens=turn.prompt.token_ids, target_start=segment.start, length=segment.length,
            source_tokens=source_tokens, source_start=segment.source_start, check_layer=check_layer,
            recompute_tokens=max(1, round(budget * segment.length)), query_tail=QUERY_TAIL)
        answer = client.segment_fidelity(request)[0]  # spectra: rank 0's heads; errors: all ranks
        for layer, measures in enumerate(answer["layers"]):
            rows.append({
                "context": context, "trajectory_id": row.trajectory_id, "turn_id": row.turn_id, "agent": row.agent,
                "agent_index": turn.turn_index, "segment": segment.id, "source_agent": segment.source_agent,
                "preceded_by": preceded_by, "layer": layer, **measures,
                "layer_error": answer["layer_error"][layer], "tokens": answer["tokens"],
                "recompute_tokens": answer["recompute_tokens"], "deviation_removed": answer["deviation_removed"],
                "attention_removed": answer["attention_removed"], "budget": budget, "check_layer": check_layer,
                "feature_dim": answer["feature_dim"]})
    return rows


def _error_rows(base_url: str, model: str, turn: TurnSpans, row: Any, first_context: int,
                context: int, method: str) -> list[dict[str, Any]]:
    from kvbench.replay.kv_error import dense_reference_of
    from kvbench.server.worker_rpc import WorkerClient

    reference = dense_reference_of(base_url, model, row.request_id, turn.prompt.token_ids)
    client = WorkerClient(base_url)
    rows = []
    for segment in turn.prompt.plan.segments:
        if segment.kind != "ph":
            continue
        per_rank = client.kv_error(row.request_id, reference, segment.start, segment.start + segment.length)
        for layer, shards in enumerate(zip(*(rank["layers"] for rank in per_rank))):
            rows.append({"context": context, "method": method, "trajectory_id": row.trajectory_id,
                         "turn_id": row.turn_id, "agent": row.agent, "agent_index": turn.turn_index,
                         "segment": segment.id, "layer": layer, "context_layer": layer >= first_context,
                         **{f"{name}_{part}": sum(s[f"{name}_{part}"] for s in shards)
                            for name in ("k", "v") for part in ("sq_err", "sq_ref")}})
    return rows


def _prompts_of(run_dir: Path, trajectories: int | None) -> tuple[pd.DataFrame, dict[tuple[str, str], list[int]],
                                                                 dict[tuple[str, str], TurnSpans]]:
    """A run's measured requests (the last `trajectories`, or all), its outputs, and every turn's
    prompt rebuilt from them."""
    import json

    from kvbench.experiment.run import trace_of_run
    from kvbench.replay.reference import read_outputs

    config = json.loads((run_dir / run_files.CONFIG).read_text())
    trace, tokenizer = trace_of_run(config)
    requests = _measured(pd.read_parquet(run_dir / run_files.REQUESTS), trajectories)
    outputs = read_outputs(run_dir)
    builder = PromptBuilder(tokenizer, trace.header.prompt_prefix_ids, run_id=str(config["run_id"]))
    wanted = set(requests["trajectory_id"])
    turns = replayed_prompts([t for t in trace.trajectories if t.trajectory_id in wanted], outputs, builder)
    for row in requests.itertuples(index=False):
        _check_prompt(row, turns[(row.trajectory_id, row.turn_id)].prompt)
    return requests, outputs, turns


def record_fidelity(error_trajectories: int = 3, budget: float = RECOMPUTE_BUDGET) -> AfterCell:
    """An `after_cell` hook for single-stream cells. Every connector method's cell: the KV error
    of what it served (fidelity_errors.parquet) over its last `error_trajectories` trajectories
    (whose saved caches the segment store still holds). FullShared's cell also measures every
    shared segment (fidelity_segments.parquet) on its server (NonShared's is plain vLLM, without
    kvbench's worker RPCs), in the prompts of NonShared's cell of the same trace where the sweep
    ran one first (the dense workflow), else in its own."""
    def after_cell(cell: SweepCell, server: Any, summary: dict[str, Any]) -> None:
        from kvbench.experiment.sweep import cell_dir, cell_done
        from kvbench.model.store import first_context_layer
        from kvbench.server.worker_rpc import WorkerClient

        if cell.qps != 0 or cell.method.method == "nonshared":
            return  # loaded cells' turns overlap; NonShared is the dense reference itself
        model = server.config.model
        first_context = first_context_layer(model)
        requests, _, turns = _prompts_of(cell.path, error_trajectories)
        rows: list[dict[str, Any]] = []
        for row in requests.itertuples(index=False):
            rows += _error_rows(server.base_url, model, turns[(row.trajectory_id, row.turn_id)], row, first_context,
                                cell.shared_tokens, cell.method.name)
        pd.DataFrame(rows).to_parquet(cell.path / run_files.FIDELITY_ERRORS, index=False)
        if cell.method.method != "fullshared" or cell.method.params:
            return
        root = cell.path.parents[2]  # <sweep>/runs/<method>/<cell>
        dense = cell_dir(root, MethodConfig("nonshared"), cell.trace_id, cell.qps, cell.repeat)
        requests, outputs, turns = _prompts_of(dense if cell_done(dense) else cell.path, None)
        client = WorkerClient(server.base_url, timeout_s=1800)
        rows = []
        for row in requests.itertuples(index=False):
            rows += _segment_rows(client, turns[(row.trajectory_id, row.turn_id)], row, outputs, turns, first_context,
                                  budget, cell.shared_tokens)
        pd.DataFrame(rows).to_parquet(cell.path / run_files.FIDELITY_SEGMENTS, index=False)
    return after_cell
