"""`gen-trace --task mmlu|gsm8k|humaneval`: the paper's agent workloads on benchmark items.

The structure the KVCMAS paper takes from KVComm: three task agents read the question in turn,
each also reading its predecessors' outputs, then a reflection agent (FinalRefer) reads all three
and gives the final answer, in the format its role prompt names (the markers below, which
analysis/benchmark_scoring.py parses). The question is the shared segment every agent reads.
Role texts are kvbench's own.

A model with a chat template gets its prompts in that template (system message: the role; user
message: the question and the notes); the glue the template adds becomes agent-specific text
segments, so the shared segments stay token-identical across agents. Models without one (the
embedded models) get plain text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbench.tracegen.datasets import BenchmarkTask, TaskItem
from kvbench.tracegen.roles import Role
from kvbench.tracegen.schema import OUT_PREFIX, Agent, Segment, SharedText, Task, Trajectory, Turn, TurnAnswer
from kvbench.tracegen.tokenizer import TraceTokenizer

# What the final agent is told to end with; analysis/benchmark_scoring.py parses exactly these.
GSM8K_ANSWER_MARKER = "The answer is"
MMLU_ANSWER_MARKER = "Answer:"

_GLUE = dict(
    task_intro="Question:\n\n",
    peer_intro="\n\nWhat your teammates wrote so far:",
    peer_glue="\n\n--- {agent} ({role}) ---\n",
    answer_prefix="\n\nYour turn.",
)
_CODE_GLUE = dict(_GLUE, task_intro="Function to implement:\n\n")


def _role(name: str, system: str, glue: dict[str, str] = _GLUE) -> Role:
    return Role(name, system, **glue)


_REFLECT = ("You write the team's final answer. Weigh what your teammates wrote, settle any disagreement "
            "between them by checking the question yourself, and keep your reasoning short. ")

BENCHMARK_ROLES: dict[str, tuple[Role, ...]] = {
    "mmlu": (
        _role("Knowledgeable Expert",
              "You are the team member who knows the background. Recall the facts, definitions and results "
              "the question depends on, and say briefly how each one bears on the choices."),
        _role("Wiki Searcher",
              "You are the team member who looks things up. Write what a reference work would say about "
              "the key terms of the question, as short factual notes, and point out which choice they "
              "support or rule out."),
        _role("Critic",
              "You are the team member who checks the others. Go through each choice, say what speaks "
              "against it, and point out any mistake in your teammates' notes."),
        _role("FinalRefer",
              _REFLECT + f"End with a line of the form '{MMLU_ANSWER_MARKER} X', where X is the letter "
              "(A, B, C or D) of the correct choice, and write nothing after it."),
    ),
    "gsm8k": (
        _role("Math Solver",
              "You are the team member who solves the problem. Work through it step by step, writing "
              "each calculation out, and state the number you arrive at."),
        _role("Mathematical Analyst",
              "You are the team member who analyses the problem. Name the quantities it gives and the one "
              "it asks for, write down how they relate, then compute, checking each value against your "
              "teammates' work."),
        _role("Programming Expert",
              "You are the team member who programs. Write a short Python function without parameters "
              "that computes the answer to the problem, with a clear name for every quantity, and say "
              "what it returns."),
        _role("FinalRefer",
              _REFLECT + f"End with a line of the form '{GSM8K_ANSWER_MARKER} N.', where N is the final "
              "number alone, without units."),
    ),
    "humaneval": (
        _role("Project Manager",
              "You are the team member who plans. Read the function's signature and documentation, list "
              "the steps an implementation needs, and name the edge cases its tests are likely to "
              "check.", _CODE_GLUE),
        _role("Algorithm Designer",
              "You are the team member who designs the algorithm. Describe the approach in a few lines "
              "of pseudocode, with its cost, and say how it handles the edge cases.", _CODE_GLUE),
        _role("Programming Expert",
              "You are the team member who writes the code. Implement the function in Python, following "
              "the plan and the design, in one code block.", _CODE_GLUE),
        _role("FinalRefer",
              _REFLECT + "Write the complete function, with its signature and any imports it needs, "
              "in one ```python code block, and nothing after the block.", _CODE_GLUE),
    ),
}
# Task agents first, FinalRefer last: A0 -> A1 -> A2 -> A3, each reading every earlier output.
NUM_AGENTS = 4


@dataclass(frozen=True)
class ChatFrame:
    """The text a chat template puts around one system and one user message, ending with the
    assistant's header: `before` + system + `between` + user + `after`."""

    before: str
    between: str
    after: str


_SYSTEM_MARK, _USER_MARK = "\x00KVBENCH-SYSTEM\x00", "\x00KVBENCH-USER\x00"


def chat_frame(tokenizer: TraceTokenizer) -> ChatFrame | None:
    """The model's chat template split at the two messages, or None when it has none. A template
    that takes no system message gets the role text at the start of the user message. The BOS
    text the template writes is dropped: the trace header's prompt prefix carries it."""
    template_owner: Any = tokenizer.chat
    if template_owner is None:
        return None

    def render(messages: list[dict[str, str]]) -> str:
        return str(template_owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    try:
        text = render([{"role": "system", "content": _SYSTEM_MARK}, {"role": "user", "content": _USER_MARK}])
        before, rest = text.split(_SYSTEM_MARK)
        between, after = rest.split(_USER_MARK)
    except Exception:  # noqa: BLE001 - templates raise what they like on a system message
        text = render([{"role": "user", "content": _SYSTEM_MARK + "\n\n" + _USER_MARK}])
        before, rest = text.split(_SYSTEM_MARK)
        between, after = rest.split(_USER_MARK)
    bos = getattr(template_owner, "bos_token", None)
    if bos and tokenizer.prompt_prefix_ids and before.startswith(bos):
        before = before[len(bos):]
    return ChatFrame(before, between, after)


def _segments(role: Role, peers: list[tuple[str, Role]], frame: ChatFrame | None,
              count: Callable[[str], int]) -> list[Segment]:
    def text(value: str) -> Segment:
        return Segment(pf="text", text=value, num_tokens=count(value))

    intro = (frame.between if frame else "\n\n") + role.task_intro
    segments = ([text(frame.before)] if frame and frame.before else []) + [Segment(pf="system"), text(intro),
                                                                          Segment(ph="q")]
    for k, (turn_id, peer) in enumerate(peers):
        segments += [text((role.peer_intro if k == 0 else "") + role.peer_glue.format(agent=turn_id.split(".")[0],
                                                                                       role=peer.name)),
                     Segment(ph=OUT_PREFIX + turn_id)]
    segments.append(text(role.answer_prefix + (frame.after if frame else "\n\n")))
    return segments


def benchmark_trajectory(task: BenchmarkTask, item: TaskItem, index: int, arrival_s: float, output_len: int,
                         frame: ChatFrame | None, count: Callable[[str], int]) -> Trajectory:
    """One item's workflow: A0-A2 the task agents, A3 FinalRefer; only A3's answer is scored."""
    roles = BENCHMARK_ROLES[task]
    agents = {f"A{i}": Agent(role=r.name, system=r.system, system_tokens=count(r.system)) for i, r in enumerate(roles)}
    turns = []
    for i, role in enumerate(roles):
        peers = [(f"A{j}.r0", roles[j]) for j in range(i)]
        turns.append(Turn(turn_id=f"A{i}.r0", agent=f"A{i}", after=[f"A{i - 1}.r0"] if i else [],
                          max_tokens=output_len, segments=_segments(role, peers, frame, count),
                          stop_at_eos=True))
    final = turns[-1].turn_id
    question = item.question  # HumanEval: exactly the prompt its tests are appended to
    return Trajectory(
        trajectory_id=f"t{index:06d}", arrival_s=arrival_s, agents=agents,
        shared={"q": SharedText(text=question, num_tokens=count(question))}, turns=turns,
        task=Task(name=task, answers=[TurnAnswer(turn_id=final, answer=item.gold)], final_turn=final,
                  item_id=item.item_id, test=item.test, entry_point=item.entry_point))
