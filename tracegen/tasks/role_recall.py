"""`gen-trace --task role-recall`: a recall task whose answer depends on who reads the table.

The shared segment is a routing table in which every queue has two routes, one line each:

    Tool output (routing table, two routes per queue).
    amber river -> cedar moss
    amber river >> pine slate
    ...
    End of table. <filler>

    Start from amber river.

Each agent's system prompt names the route it follows (`main`, the `->` line, or `fallback`, the
`>>` line; tracegen/roles.py, preset `role-recall`, alternating along the workflow). Like `recall`,
a turn looks up the name in the last note it sees (the start name when it sees none) and writes
the route's target, so gold answers differ per agent and chain along the workflow. An agent that
reads with another agent's reading answers that agent's question: the error a reused cache makes
on a model that applies the reading while it prefills the table (kvbench.model.roles).

Layout is fixed so that a token's role in the table is a function of its index: the header has a
fixed length, every record has the same number of tokens (12 on the embedded tokenizer; on others,
names are drawn from the words of one token shape so that this holds), and the variable remainder
goes after the table. Real tool outputs with a schema have this shape too; it is
what token-wise transfer of corrections between contents needs (docs/models.md).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvbench.tracegen.roles import ROUTE_ARROWS, ROUTE_WORDS, Role
from kvbench.tracegen.schema import OUT_PREFIX, SharedText, Task, Trajectory, TurnAnswer
from kvbench.tracegen.tasks.base import Counter as TokenCounts
from kvbench.tracegen.tasks.base import Score, TaskDefinition
from kvbench.tracegen.tasks.recall import NAME_WORDS, answer_of, hops_needed, recall_output_len
from kvbench.tracegen.text import document_words

HEADER = "Tool output (routing table, two routes per queue)."
TABLE_END = "\n\nEnd of table."
MIN_RECORDS = 3  # every route points at another record's key: at least three keys


@dataclass(frozen=True)
class Record:
    key: str
    routes: tuple[str, ...]  # one target per reading, ROUTE_ARROWS order

    def text(self) -> str:
        return "".join(f"\n{self.key} {arrow} {target}" for arrow, target in zip(ROUTE_ARROWS, self.routes))


@dataclass(frozen=True)
class RoleRecallContext:
    text: str
    records: dict[str, Record]  # by key, in table order
    start: str
    positions: dict[str, float]  # key -> where its record starts, as a share of the segment's tokens


def _question(start: str) -> str:
    return f"\n\nStart from {start}."


def role_recall_context(rng: random.Random, num_tokens: int, counter: TokenCounts,
                        filler: Callable[[], str]) -> RoleRecallContext:
    """The shared segment, exactly `num_tokens` tokens: header, as many records as fit, the table's
    end with filler, then the question."""
    keys: list[str] = []
    seen: set[str] = set()
    words = same_shape_words(counter)

    def new_name() -> str:
        while True:
            name = f"{rng.choice(words)} {rng.choice(words)}"
            if name not in seen:
                seen.add(name)
                return name

    header_tokens = counter.count(HEADER)
    keys.append(new_name())
    start = keys[0]
    question_tokens = counter.count(_question(start))
    budget = num_tokens - header_tokens - question_tokens - counter.count(TABLE_END)
    # Every record holds its key and two other keys: the lines' lengths are known once keys are;
    # draw keys while their records (with placeholder targets of the same shape) still fit.
    record_tokens = counter.count(Record(start, (start, start)).text())
    capacity = max(0, budget // record_tokens)
    if capacity > len(words) ** 2 // 2:
        raise ValueError(f"--shared-tokens {num_tokens}: more records than distinct names ({len(words)} name words "
                         "of one token shape under this tokenizer)")
    while len(keys) < capacity:
        keys.append(new_name())
    if len(keys) < MIN_RECORDS:
        raise ValueError(f"--shared-tokens {num_tokens} is too small for a role-recall table "
                         f"(needs {MIN_RECORDS} records of {record_tokens} tokens after a "
                         f"{header_tokens}-token header)")
    rng.shuffle(keys)
    records: dict[str, Record] = {}
    for key in keys:
        targets = rng.sample([k for k in keys if k != key], len(ROUTE_ARROWS))
        records[key] = Record(key, tuple(targets))
    table = "".join(r.text() for r in records.values())
    counts = counter.counts([r.text() for r in records.values()])
    if set(counts) != {record_tokens}:  # a tokenizer that merges across the words' boundaries
        raise ValueError(f"role-recall needs records of one token length; under this tokenizer they have "
                         f"{sorted(set(counts))} tokens although their words have one shape")
    positions, offset = {}, header_tokens
    for key, tokens in zip(records, counts):
        positions[key] = round(offset / num_tokens, 4)
        offset += tokens
    tail_tokens = num_tokens - offset - question_tokens
    for _ in range(8):  # pieces' counts may not add up exactly at their boundaries: re-verify
        words = document_words(rng, tail_tokens)
        words[0] = " " + words[0]  # a document's first word comes without its separator
        tail = counter.fit([TABLE_END, *words], tail_tokens, filler)
        text = HEADER + table + tail + _question(start)
        diff = counter.count(text) - num_tokens
        if diff == 0:
            return RoleRecallContext(text=text, records=records, start=start, positions=positions)
        tail_tokens -= diff
    raise ValueError(f"could not build a role-recall segment of exactly {num_tokens} tokens")


def same_shape_words(counter: TokenCounts) -> tuple[str, ...]:
    """The name words that take the same number of tokens as most do, at a line's start and after a
    space: records built from them all have one token length under this tokenizer (the fixed
    layout), whatever the tokenizer (the embedded one keeps every word)."""
    shapes = {word: (counter.count("\n" + word), counter.count(" " + word)) for word in NAME_WORDS}
    modal = Counter(shapes.values()).most_common(1)[0][0]
    words = tuple(word for word in NAME_WORDS if shapes[word] == modal)
    if len(words) < MIN_RECORDS:
        raise ValueError(f"role-recall needs at least {MIN_RECORDS} name words of one token shape; this tokenizer "
                         f"has {len(words)}")
    return words


def parse_table(text: str) -> dict[str, tuple[str, ...]]:
    """Routes by key, read off a segment's text line by line (as an agent must)."""
    routes: dict[str, list[str]] = {}
    for line in text.splitlines():
        for reading, arrow in enumerate(ROUTE_ARROWS):
            key, sep, target = line.partition(f" {arrow} ")
            if sep:
                routes.setdefault(key, [""] * len(ROUTE_ARROWS))[reading] = target
    return {key: tuple(targets) for key, targets in routes.items()}


def reading_of(system_prompt: str) -> int:
    """The route a role follows, from the one route word its system prompt names."""
    named = [i for i, word in enumerate(ROUTE_WORDS) if f" {word} route" in system_prompt]
    if len(named) != 1:
        raise ValueError(f"a role-recall system prompt names exactly one of {ROUTE_WORDS} routes; this one: "
                         f"{system_prompt[:80]!r}...")
    return named[0]


def role_recall_answers(trajectory: Trajectory, routes: Mapping[str, Sequence[str]], start: str,
                        readings: Mapping[str, int]) -> dict[str, str]:
    """Each turn's gold answer: the route its agent follows from the last note it sees (or the
    start name), outputs appearing in trace order."""
    answers: dict[str, str] = {}
    for turn in trajectory.turns:
        notes = [s.ph[len(OUT_PREFIX):] for s in turn.segments if s.ph and s.ph.startswith(OUT_PREFIX)]
        key = answers[notes[-1]] if notes else start
        answers[turn.turn_id] = routes[key][readings[turn.agent]]
    return answers


def role_recall_task(trajectory: Trajectory, context: RoleRecallContext) -> Task:
    """The task block: gold answers, where each answer's record starts, and the final turn (the
    latest of the turns farthest along the chain)."""
    readings = {name: reading_of(agent.system) for name, agent in trajectory.agents.items()}
    routes = {key: record.routes for key, record in context.records.items()}
    answers = role_recall_answers(trajectory, routes, context.start, readings)
    keys: dict[str, str] = {}
    for turn in trajectory.turns:  # the record each turn reads: its key is the previous answer
        notes = [s.ph[len(OUT_PREFIX):] for s in turn.segments if s.ph and s.ph.startswith(OUT_PREFIX)]
        keys[turn.turn_id] = answers[notes[-1]] if notes else context.start
    hops = hops_needed(trajectory)
    deepest = max(hops.values())
    final = [t.turn_id for t in trajectory.turns if hops[t.turn_id] == deepest][-1]
    return Task(name="role-recall", final_turn=final,
                answers=[TurnAnswer(turn_id=t.turn_id, answer=answers[t.turn_id],
                                    position=context.positions[keys[t.turn_id]]) for t in trajectory.turns])


class RoleRecall(TaskDefinition):
    name = "role-recall"
    summary = "recall in a two-route table where each agent's role names its route (answers differ per agent)"
    roles = "role-recall"
    # a model that reads the role's route (a constructed role family, kvbench.model.roles)
    model = "kvbench:roles-transferable"

    def default_output_len(self, encode: Callable[[str], list[int]]) -> int:
        return recall_output_len(encode)

    def check_roles(self, roles: Sequence[Role]) -> None:
        if any(r.reading is None for r in roles):
            raise ValueError("--task role-recall needs roles that name a reading (--roles role-recall)")

    def build(self, draft: Trajectory, rng: random.Random, shared_tokens: int, counter: TokenCounts,
              filler: Callable[[], str]) -> Trajectory:
        context = role_recall_context(rng, shared_tokens, counter, filler)
        draft = draft.model_copy(update={"shared": {"q": SharedText(text=context.text, num_tokens=shared_tokens)}})
        return draft.model_copy(update={"task": role_recall_task(draft, context)})

    def score(self, text: str, gold: TurnAnswer, trajectory: Trajectory) -> Score:
        answer = answer_of(text)
        return Score(answer=answer, correct=answer == gold.answer)


TASK = RoleRecall()
