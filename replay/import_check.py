"""Whether the prompts kvbench builds from an imported log are the log's own, token for token
(`kvbench trace import` names the ones that are not)."""

from __future__ import annotations

from collections import defaultdict

from kvbench.replay.prompts import PromptBuilder, TurnPrompt
from kvbench.tracegen.chat_import import log_prompt_ids
from kvbench.tracegen.chat_log import ChatRecord
from kvbench.tracegen.schema import Trajectory
from kvbench.tracegen.tokenizer import TraceTokenizer


def prompt_mismatches(records: list[ChatRecord], trajectories: list[Trajectory],
                      tokenizer: TraceTokenizer) -> list[str]:
    """Requests whose prompt, built from the trace with the log's responses as the outputs, is not
    the log's prompt token for token (each as 'trajectory/turn: why')."""
    problems = []
    by_session: dict[str, list[ChatRecord]] = defaultdict(list)
    for record in records:
        by_session[record.session].append(record)
    for trajectory in trajectories:
        members = sorted(by_session[trajectory.trajectory_id], key=lambda r: r.order)
        builder = PromptBuilder(tokenizer, tokenizer.prompt_prefix_ids, run_id="import-check")
        outputs = {t.turn_id: tokenizer.encode(r.response) for t, r in zip(trajectory.turns, members)}
        prompts: dict[str, TurnPrompt] = {}
        for turn, record in zip(trajectory.turns, members):
            built = builder.build(trajectory, turn, outputs, prompts)
            prompts[turn.turn_id] = built
            expected = log_prompt_ids(record, tokenizer)
            if built.token_ids != expected:
                at = next((i for i, (x, y) in enumerate(zip(built.token_ids, expected)) if x != y),
                          min(len(built.token_ids), len(expected)))
                problems.append(f"{trajectory.trajectory_id}/{turn.turn_id}: differs from token {at} "
                                f"({len(built.token_ids)} tokens built, {len(expected)} in the log)")
    return problems
