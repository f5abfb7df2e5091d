"""`gen-trace --task role-lookup`: each agent reports another fact about one person, found in a
long tool output; the real-model form of role-recall.

The shared segment is a tool's output: prose (with no numbers in it) through which one sentence
per fact about the request's subject is scattered at random places:

    Tool output (case file). The careful engineer reviewed the market near the quiet river. ...
    The access code of Lena Costa is 4821. ... The home city of Lena Costa is Lisbon. ...

Each agent's role names the fact it reports (tracegen/roles.py, preset `role-lookup`: access code,
home city, car color, room number, ...), and its own last prompt segment asks for it by the words
the sentence uses ("What is the access code of Lena Costa?"). Answers therefore differ by the
reading agent although every agent reads the same context, and each turn's answer is in the
shared segment, at a recorded position: a method whose reused cache loses the context loses
answers. The earlier agents' notes are in later prompts, as in every workflow (a distraction the
answer must not copy).

Built for real pretrained chat models: SmolLM2-135M-Instruct answers it from a 2K context
(docs/models.md), where it fails recall's forwarding tables. Question and fact sentence share
their wording, and the prose holds no other numbers, because a 135M model is led astray by either.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbench.tracegen.roles import ROLE_POOL, Role
from kvbench.tracegen.schema import Segment, SharedText, Task, Trajectory, TurnAnswer
from kvbench.tracegen.tasks.base import Counter, Score, TaskDefinition
from kvbench.tracegen.tasks.recall import answer_of
from kvbench.tracegen.text import document_words

HEADER = "Tool output (case file)."
SUBJECT = "{subject}"  # where the roles' questions name the subject (filled in per trajectory)
FIRST_NAMES = ("Maria James Omar Lena Ravi Sofia Ken Ines Paul Yara Hugo Mina Ivan Nora Theo Zara Liam Ada Emil "
               "Rosa").split()
LAST_NAMES = "Lopez Chen Baker Silva Novak Tanaka Okafor Berg Rossi Patel Moreau Costa Ueda Varga Wagner Kim".split()


@dataclass(frozen=True)
class Fact:
    """A kind of fact: its values and the sentence that states it."""

    values: Callable[[random.Random], str]
    sentence: str = "The {fact} of {subject} is {value}."

    def text(self, fact: str, subject: str, value: str) -> str:
        return self.sentence.format(fact=fact, subject=subject, value=value)


def _words(text: str) -> Callable[[random.Random], str]:
    words = text.split()
    return lambda rng: rng.choice(words)


FACTS: dict[str, Fact] = {
    "access code": Fact(lambda rng: str(rng.randrange(1000, 10000))),
    "home city": Fact(_words("Paris Madrid Berlin Lisbon Vienna Prague Dublin Oslo Athens Warsaw Rome Zurich Helsinki "
                             "Budapest")),
    "car color": Fact(_words("red blue green yellow black white orange purple silver brown")),
    "room number": Fact(lambda rng: str(rng.randrange(100, 1000))),
    "pet": Fact(_words("parrot turtle rabbit hamster goldfish kitten puppy pony"), "The pet of {subject} is a {value}."),
    "department": Fact(_words("finance sales marketing research legal logistics support design")),
    "birth month": Fact(_words("January February March April May June July August September October November "
                               "December")),
    "favorite fruit": Fact(_words("mango cherry banana apple pear peach lemon plum")),
}


def lookup_context(rng: random.Random, num_tokens: int, subject: str, facts: dict[str, str], counter: Counter,
                   filler: Callable[[], str]) -> tuple[str, dict[str, float]]:
    """The shared segment (exactly `num_tokens` tokens) and where each fact's sentence starts, as
    a share of its tokens. `facts`: fact -> value."""
    sentences = {fact: FACTS[fact].text(fact, subject, value) for fact, value in facts.items()}
    header_tokens = counter.count(HEADER)
    fact_tokens = sum(counter.count(" " + s) for s in sentences.values())
    budget = num_tokens - header_tokens - fact_tokens - 8  # a margin for merges at the pieces' boundaries
    if budget < 2 * len(sentences):
        raise ValueError(f"--shared-tokens {num_tokens} is too small for {len(sentences)} facts "
                         f"({header_tokens + fact_tokens} tokens with the header)")
    for _ in range(8):  # a fact cut off by the exact fit (pieces' counts not adding up): draw again
        words = document_words(rng, budget, digits=False)
        words[0] = " " + words[0]  # a document's first word comes without its separator
        counts = counter.counts(words)
        kept, total = 0, 0
        while kept < len(words) and total + counts[kept] <= budget:
            total += counts[kept]
            kept += 1
        words = words[:kept]
        # facts go between sentences, each at its own random place
        starts = [i for i in range(len(words) + 1) if i == 0 or words[i - 1].endswith(".")]
        places = sorted(rng.sample(starts, len(sentences)) if len(starts) >= len(sentences)
                        else rng.choices(starts, k=len(sentences)), reverse=True)
        order = list(sentences.values())
        rng.shuffle(order)
        for place, sentence in zip(places, order):
            words.insert(place, " " + sentence)
        text = counter.fit([HEADER, *words], num_tokens, filler)
        if all(s in text for s in sentences.values()):
            return text, {fact: round(counter.count(text[: text.index(s)]) / num_tokens, 4)
                          for fact, s in sentences.items()}
    raise ValueError(f"could not build a role-lookup segment of exactly {num_tokens} tokens")


def reported_fact(role_name: str) -> str:
    role = ROLE_POOL.get(role_name)
    if role is None or role.reports is None:
        raise ValueError(f"role {role_name!r} reports no fact (--task role-lookup needs --roles role-lookup)")
    return role.reports


def with_subject(turn_segments: Sequence[Segment], subject: str, counter: Counter) -> list[Segment]:
    """The turn's segments with its question naming the subject."""
    out = []
    for segment in turn_segments:
        if segment.pf == "text" and segment.text is not None and SUBJECT in segment.text:
            text = segment.text.replace(SUBJECT, subject)
            segment = Segment(pf="text", text=text, num_tokens=counter.count(text))
        out.append(segment)
    return out


def correct(answer: str, gold: str) -> bool:
    """Whether the answer line names the gold value as a word of its own (any case)."""
    return re.search(rf"(?<!\w){re.escape(gold)}(?!\w)", answer, re.IGNORECASE) is not None


class RoleLookup(TaskDefinition):
    name = "role-lookup"
    summary = ("each agent reports the fact its role names (access code, home city, ...) about one person, "
               "scattered through a long tool output (answers differ per agent; for real chat models)")
    roles = "role-lookup"
    model = "kvbench:smollm2-135m"  # a real pretrained chat model that answers it (docs/models.md)
    reads_text = True

    def default_output_len(self, encode: Callable[[str], list[int]]) -> int:
        return 32  # a cap: "The access code of Lena Costa is 4821." and the end of the message

    def check_roles(self, roles: Sequence[Role]) -> None:
        if any(r.reports is None for r in roles):
            raise ValueError("--task role-lookup needs roles that report a fact (--roles role-lookup)")

    def build(self, draft: Trajectory, rng: random.Random, shared_tokens: int, counter: Counter,
              filler: Callable[[], str]) -> Trajectory:
        subject = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
        reported = {name: reported_fact(agent.role) for name, agent in draft.agents.items()}
        values = {fact: FACTS[fact].values(rng) for fact in dict.fromkeys(reported.values())}
        text, positions = lookup_context(rng, shared_tokens, subject, values, counter, filler)
        turns = [turn.model_copy(update={"segments": with_subject(turn.segments, subject, counter)})
                 for turn in draft.turns]
        answers = [TurnAnswer(turn_id=t.turn_id, answer=values[reported[t.agent]], position=positions[reported[t.agent]])
                   for t in turns]
        return draft.model_copy(update={"shared": {"q": SharedText(text=text, num_tokens=shared_tokens)},
                                        "turns": turns,
                                        "task": Task(name=self.name, answers=answers, final_turn=turns[-1].turn_id)})

    def score(self, text: str, gold: TurnAnswer, trajectory: Trajectory) -> Score:
        answer = answer_of(text)
        return Score(answer=answer, correct=correct(answer, gold.answer))


TASK = RoleLookup()
