"""Greedy recall chains in transformers, with prompts built by the replayer's own PromptBuilder
(each turn's upstream outputs are the ids the model generated)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvbench.replay.prompts import PromptBuilder
from kvbench.tracegen.schema import Trajectory, Turn
from kvbench.tracegen.tasks.recall import answer_of
from kvbench.tracegen.tokenizer import TraceTokenizer


def turn_prompt(tokenizer: TraceTokenizer, trajectory: Trajectory, turn: Turn, outputs: dict[str, list[int]]) -> list[int]:
    builder = PromptBuilder(tokenizer, prefix_ids=[], run_id="test")
    return [i for segment in turn.segments for i in builder.segment_ids(trajectory, turn, segment, outputs)]


def greedy(model_dir: Path, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Greedy continuation and the log-probability of its first token."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    first = torch.log_softmax(out.scores[0][0].float(), -1)
    return out.sequences[0, len(prompt):].tolist(), float(first.max())


def chain_accuracy(model_dir: Path, tokenizer: TraceTokenizer, trajectories: list[Trajectory]) -> tuple[int, int]:
    """(exact answers, turns) of greedy chains through every trajectory."""
    right = total = 0
    for trajectory in trajectories:
        outputs: dict[str, list[int]] = {}
        gold = {a.turn_id: a.answer for a in trajectory.task.answers}
        for turn in trajectory.turns:
            outputs[turn.turn_id], _ = greedy(model_dir, turn_prompt(tokenizer, trajectory, turn, outputs), turn.max_tokens)
            right += answer_of(tokenizer.decode(outputs[turn.turn_id])) == gold[turn.turn_id]
            total += 1
    return right, total
