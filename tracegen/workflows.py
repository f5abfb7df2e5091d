"""Workflow shapes: which turns run, in what order, and which turns each one waits for."""

from __future__ import annotations

from dataclasses import dataclass

WORKFLOWS: tuple[str, ...] = ("sequential", "loop", "fan-out", "fan-in")


@dataclass(frozen=True)
class TurnNode:
    turn_id: str
    agent_index: int
    after: tuple[str, ...]


def _tid(agent: int, round_index: int) -> str:
    return f"A{agent}.r{round_index}"


def workflow_turns(workflow: str, num_agents: int, rounds: int) -> list[TurnNode]:
    """Turns in a valid execution (topological) order.

    - sequential: A0 -> A1 -> ... -> A(n-1); each further round continues the chain from A0.
    - loop: A0 once (e.g. a planner), then A1 -> ... -> A(n-1) repeated `rounds` times, the last
      agent feeding back into A1 (an iterate-and-critique loop).
    - fan-out: A0 -> {A1, ..., A(n-1)} in parallel.
    - fan-in: {A0, ..., A(n-2)} in parallel -> A(n-1).
    For fan-out and fan-in, each further round starts after every turn of the previous round.
    """
    if workflow not in WORKFLOWS:
        raise ValueError(f"unknown workflow {workflow!r}; choose from {', '.join(WORKFLOWS)}")
    if num_agents < 2:
        raise ValueError("a workflow needs at least 2 agents")
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    turns: list[TurnNode] = []
    if workflow in ("sequential", "loop"):
        previous: tuple[str, ...] = ()
        for r in range(rounds):
            first = 0 if (workflow == "sequential" or r == 0) else 1
            for a in range(first, num_agents):
                turns.append(TurnNode(_tid(a, r), a, previous))
                previous = (_tid(a, r),)
        return turns
    previous_round: tuple[str, ...] = ()
    for r in range(rounds):
        if workflow == "fan-out":
            root = TurnNode(_tid(0, r), 0, previous_round)
            leaves = [TurnNode(_tid(a, r), a, (root.turn_id,)) for a in range(1, num_agents)]
            round_turns = [root, *leaves]
            previous_round = tuple(t.turn_id for t in leaves)
        else:
            leaves = [TurnNode(_tid(a, r), a, previous_round) for a in range(num_agents - 1)]
            sink = TurnNode(_tid(num_agents - 1, r), num_agents - 1, tuple(t.turn_id for t in leaves))
            round_turns = [*leaves, sink]
            previous_round = (sink.turn_id,)
        turns.extend(round_turns)
    return turns
