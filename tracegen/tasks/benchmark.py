"""`gen-trace --task mmlu|gsm8k|humaneval`: the paper's agent workloads on benchmark items.

The structure the KVCMAS paper takes from KVComm: three task agents read the question in turn,
each also reading its predecessors' outputs, then a reflection agent (FinalRefer) reads all three
and gives the final answer, in the format its role prompt names (which the task's module parses:
kvbench.tracegen.tasks.mmlu, gsm8k, humaneval). The question is the shared segment every agent
reads. Role texts are kvbench's own; each task's are in its module.

A model with a chat template gets its prompts in that template (system message: the role; user
message: the question and the notes); the glue the template adds becomes agent-specific text
segments, so the shared segments stay token-identical across agents. Models without one (the
embedded models) get plain text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvbench.tracegen.datasets import DatasetError, TaskItem, read_rows
from kvbench.tracegen.roles import Role
from kvbench.tracegen.schema import OUT_PREFIX, Agent, Segment, SharedText, Task, Trajectory, Turn, TurnAnswer
from kvbench.tracegen.tasks.base import TaskDefinition
from kvbench.tracegen.tokenizer import TraceTokenizer

GLUE = dict(
    task_intro="Question:\n\n",
    peer_intro="\n\nWhat your teammates wrote so far:",
    peer_glue="\n\n--- {agent} ({role}) ---\n",
    answer_prefix="\n\nYour turn.",
)
CODE_GLUE = dict(GLUE, task_intro="Function to implement:\n\n")
# The reflection agent's role text before its task's answer format.
REFLECT = ("You write the team's final answer. Weigh what your teammates wrote, settle any disagreement "
           "between them by checking the question yourself, and keep your reasoning short. ")
# Task agents first, FinalRefer last: A0 -> A1 -> A2 -> A3, each reading every earlier output.
NUM_AGENTS = 4


def benchmark_role(name: str, system: str, glue: dict[str, str] = GLUE) -> Role:
    return Role(name, system, **glue)


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


def benchmark_trajectory(task: str, roles: Sequence[Role], item: TaskItem, index: int, arrival_s: float,
                         output_len: int, frame: ChatFrame | None, count: Callable[[str], int]) -> Trajectory:
    """One item's workflow: A0-A2 the task agents, A3 FinalRefer; only A3's answer is scored."""
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


class BenchmarkTask(TaskDefinition):
    """A benchmark workload: one trajectory per item of a data file, the paper's four roles
    (`agent_roles`: three task agents, then FinalRefer), the final agent's answer scored."""

    uses_items = True
    reads_text = True
    agent_roles: ClassVar[tuple[Role, ...]]
    columns: ClassVar[tuple[str, ...]]  # what a row of its data file must hold

    def default_output_len(self, encode: Callable[[str], list[int]]) -> int:
        return 512  # a cap: its turns stop at the model's end of sequence

    def default_data(self) -> str | None:
        """The data file when --data is not given (None: --data is needed)."""
        return None

    def item(self, row: dict[str, Any], index: int, where: str) -> TaskItem:
        """One row as an item (DatasetError naming `where` and the field when it is wrong)."""
        raise NotImplementedError

    def items(self, data: str | None, limit: int | None, seed: int | None) -> list[TaskItem]:
        path = data if data is not None else self.default_data()
        if path is None:
            raise DatasetError(f"--task {self.name} needs --data PATH (a parquet or JSONL export of the dataset; "
                               "docs/running.md says where to get one)")
        return [self.item(row, index, where) for row, index, where in read_rows(path, self.name, self.columns,
                                                                               limit, seed)]

    def trajectory(self, item: TaskItem, index: int, arrival_s: float, output_len: int, frame: ChatFrame | None,
                   count: Callable[[str], int]) -> Trajectory:
        return benchmark_trajectory(self.name, self.agent_roles, item, index, arrival_s, output_len, frame, count)
