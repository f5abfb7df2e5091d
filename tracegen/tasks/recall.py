"""`gen-trace --task recall`: trajectories whose answers live in the shared context.

The shared segment is a tool's output: a line of prose, then a forwarding table of
`name -> name` lines (ticket queues, service redirects), then the name to start from. Each turn
follows one line of the table from the name in the last note it sees (the start name when it
sees none) and writes the name it finds, so agent A1 computes from A0's output, A2 from A1's,
and the final agent's answer is the end of the chain. Every hop's line sits at a random place
in the table, so the fact's position varies over the context; each turn's gold answer and that
position are in the trajectory (`task`), and `kvbench score` checks outputs against them.

It is kvbench's CPU accuracy benchmark: a small model trained on the format can answer only by
reading the shared context, and a method whose reused cache loses the context loses answers.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvbench.model.vocabulary import ARROW, NAME_WORDS
from kvbench.tracegen.schema import OUT_PREFIX, SharedText, Task, Trajectory, TurnAnswer
from kvbench.tracegen.tasks.base import Counter, Score, TaskDefinition
from kvbench.tracegen.text import document_words

MIN_PREAMBLE_TOKENS = 12


def answer_of(output_text: str) -> str:
    """What an output answers: its first non-empty line, stripped."""
    for line in output_text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def recall_output_len(encode: Callable[[str], list[int]]) -> int:
    """Tokens of the longest answer line: a name at a line's start, then a newline. An agent that
    writes exactly its answer leaves the next agent's prompt with the name right before the
    question, as the start name is for the first agent."""
    first = max(len(encode(word)) for word in NAME_WORDS)
    second = max(len(encode(" " + word)) for word in NAME_WORDS)
    return first + second + len(encode("\n"))


def _question(start: str) -> str:
    return f"\n\nStart from {start}."


def recall_context(rng: random.Random, num_tokens: int, hops: int, counter: Counter,
                   filler: Callable[[], str]) -> tuple[str, list[str], list[float]]:
    """The shared segment (exactly `num_tokens` tokens), the chain it defines (the start name,
    then one name per hop) and where each hop's line starts, as a share of the segment's tokens.

    Every name of the table has a line; the chain's `hops` lines sit at random places in it."""
    names: list[str] = []
    seen: set[str] = set()
    line_estimate = max(1, counter.count(f"{NAME_WORDS[0]} {NAME_WORDS[1]}{ARROW}{NAME_WORDS[2]} {NAME_WORDS[3]}\n"))
    wanted = max(hops + 1, (num_tokens - MIN_PREAMBLE_TOKENS) // line_estimate + 1)
    if len(NAME_WORDS) ** 2 < wanted:
        raise ValueError(f"--shared-tokens {num_tokens}: more table lines than distinct names")
    while len(names) < wanted:
        name = f"{rng.choice(NAME_WORDS)} {rng.choice(NAME_WORDS)}"
        if name not in seen:
            seen.add(name)
            names.append(name)
    chain = names[: hops + 1]
    target = {chain[i]: chain[i + 1] for i in range(hops)}
    others = names[hops:]  # the chain's last name and the rest: each points anywhere else
    for name in others:
        target[name] = rng.choice(names)
        while target[name] == name:
            target[name] = rng.choice(names)
    order = list(target)
    rng.shuffle(order)
    question = _question(chain[0])
    budget = num_tokens - counter.count(question) - MIN_PREAMBLE_TOKENS
    lines = [f"\n{name}{ARROW}{target[name]}" for name in order]
    counts = counter.counts(lines)
    # Keep lines while they fit; the chain's lines always stay (others are dropped instead).
    needed = set(chain[:-1])
    kept, total = [], sum(c for line, c, name in zip(lines, counts, order) if name in needed)
    if total > budget:
        raise ValueError(f"--shared-tokens {num_tokens} is too small for a recall table of {hops} hops")
    for line, tokens, name in zip(lines, counts, order):
        if name in needed:
            kept.append((line, tokens, name))
        elif total + tokens <= budget:
            kept.append((line, tokens, name))
            total += tokens
    table = "".join(line for line, _, _ in kept)
    preamble_tokens = num_tokens - counter.count(table + question)
    for _ in range(8):  # the pieces' counts may not add up exactly at their boundaries: re-verify
        words = document_words(rng, preamble_tokens)
        words[0] = " " + words[0]  # a document's first word comes without its separator
        preamble = counter.fit(["Tool output (forwarding table).", *words], preamble_tokens, filler)
        text = preamble + table + question
        diff = counter.count(text) - num_tokens
        if diff == 0:
            break
        preamble_tokens -= diff
    else:
        raise ValueError(f"could not build a recall segment of exactly {num_tokens} tokens")
    positions, offset = {}, counter.count(preamble)
    for _, tokens, name in kept:
        positions[name] = offset / num_tokens
        offset += tokens
    return text, chain, [round(positions[name], 4) for name in chain[:-1]]


def hops_needed(trajectory: Trajectory) -> dict[str, int]:
    """Per turn, how many lines of the table its answer is from the start name: one more than the
    answer of the last output it sees (outputs appear in trace order), or 1 if it sees none."""
    hops: dict[str, int] = {}
    for turn in trajectory.turns:
        seen = [s.ph[len(OUT_PREFIX):] for s in turn.segments if s.ph and s.ph.startswith(OUT_PREFIX)]
        hops[turn.turn_id] = hops[seen[-1]] + 1 if seen else 1
    return hops


def recall_task(trajectory: Trajectory, chain: list[str], positions: list[float]) -> Task:
    """Every turn's gold answer; the final turn is the latest of those farthest along the chain."""
    hops = hops_needed(trajectory)
    answers = [TurnAnswer(turn_id=t.turn_id, answer=chain[hops[t.turn_id]], position=positions[hops[t.turn_id] - 1])
               for t in trajectory.turns]
    deepest = max(hops.values())
    final = [t.turn_id for t in trajectory.turns if hops[t.turn_id] == deepest][-1]
    return Task(name="recall", answers=answers, final_turn=final)


class Recall(TaskDefinition):
    name = "recall"
    summary = "follow a forwarding table in the shared context, each agent one hop further (exact match)"
    roles = "recall"

    def default_output_len(self, encode: Callable[[str], list[int]]) -> int:
        return recall_output_len(encode)

    def build(self, draft: Trajectory, rng: random.Random, shared_tokens: int, counter: Counter,
              filler: Callable[[], str]) -> Trajectory:
        text, chain, positions = recall_context(rng, shared_tokens, max(hops_needed(draft).values()), counter, filler)
        q = SharedText(text=text, num_tokens=shared_tokens)
        return draft.model_copy(update={"shared": {"q": q}, "task": recall_task(draft, chain, positions)})

    def score(self, text: str, gold: TurnAnswer, trajectory: Trajectory) -> Score:
        answer = answer_of(text)
        return Score(answer=answer, correct=answer == gold.answer)


TASK = Recall()
