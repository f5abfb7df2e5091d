"""`gen-trace --task role-recall`: gold answers that follow from the table and each agent's own
route, re-derived here from the texts alone; the fixed layout that token-wise transfer needs."""

from __future__ import annotations

import re

import pytest

from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.roles import ROUTE_WORDS, roles_for
from kvbench.tracegen.tasks.role_recall import HEADER, parse_table, reading_of
from kvbench.tracegen.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)  # the shipped model's: name words are single tokens in it


@pytest.mark.parametrize(("workflow", "agents", "rounds"), [("sequential", 4, 1), ("loop", 3, 2),
                                                             ("fan-out", 4, 1), ("fan-in", 6, 1)])
def test_gold_answers_follow_from_the_table_and_each_role(tokenizer, workflow: str, agents: int, rounds: int) -> None:
    spec = TraceSpec(task="role-recall", roles="role-recall", workflow=workflow, num_agents=agents, rounds=rounds,
                     shared_tokens=800, output_len=3, num_trajectories=3, seed=11)
    _, trajectories = generate_trace(spec, tokenizer)
    for trajectory in trajectories:
        text = trajectory.shared["q"].text
        assert len(tokenizer.encode(text)) == 800
        routes = parse_table(text)
        start = re.search(r"Start from (.+)\.$", text).group(1)
        by_turn = {a.turn_id: a for a in trajectory.task.answers}
        answers: dict[str, str] = {}
        for turn in trajectory.turns:  # as an agent must: the last note's name, its own route
            notes = [s.ph.removeprefix("out:") for s in turn.segments if s.ph and s.ph.startswith("out:")]
            key = answers[notes[-1]] if notes else start
            word = next(w for w in ROUTE_WORDS if f" {w} route" in trajectory.agents[turn.agent].system)
            answers[turn.turn_id] = routes[key][ROUTE_WORDS.index(word)]
            assert by_turn[turn.turn_id].answer == answers[turn.turn_id], (turn.turn_id, key, word)
            # the position is where the record read starts, as a share of the segment's tokens
            before = text[: text.index(f"\n{key} -> ")]
            assert abs(by_turn[turn.turn_id].position - len(tokenizer.encode(before)) / 800) < 1e-3
        # the two routes of a record differ: an agent reading with the other route is wrong
        assert all(len(set(targets)) == len(targets) for targets in routes.values())
        assert all(target in routes for targets in routes.values() for target in targets)  # every hop continues


def test_consecutive_agents_read_differently(tokenizer) -> None:
    roles = roles_for("role-recall", 8)
    assert [reading_of(r.system) for r in roles] == [r.reading for r in roles] == [0, 1] * 4
    for role in roles:  # the route word appears once, in the system prompt only
        assert sum(role.system.count(f" {w} ") for w in ROUTE_WORDS) == 1
    with pytest.raises(ValueError, match="--roles role-recall"):
        TraceSpec(task="role-recall", roles="recall").validate()
    with pytest.raises(ValueError, match="exactly one"):
        reading_of("Follow the main route, or the fallback route.")


def test_the_table_has_a_fixed_layout(tokenizer) -> None:
    """Every record is 12 tokens from the same offset in every content: a token's class in the
    table is a function of its index (what token-wise transfer of corrections relies on)."""
    _, trajectories = generate_trace(TraceSpec(task="role-recall", roles="role-recall", shared_tokens=2048,
                                               output_len=3, num_trajectories=3, seed=2), tokenizer)
    header = len(tokenizer.encode(HEADER))
    arrows = {tokenizer.encode(" ->")[0], tokenizer.encode(" >>")[0]}
    layouts = []
    for trajectory in trajectories:
        ids = tokenizer.encode(trajectory.shared["q"].text)
        records = len(parse_table(trajectory.shared["q"].text))
        table = ids[header:header + 12 * records]
        assert [i for i, token in enumerate(table) if token in arrows] == [3 + 6 * k for k in range(2 * records)]
        layouts.append(records)
    assert len(set(layouts)) == 1  # the same number of records at the same context size


def test_too_small_a_context_is_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="too small for a role-recall table"):
        generate_trace(TraceSpec(task="role-recall", roles="role-recall", shared_tokens=40, output_len=3,
                                 num_trajectories=1), tokenizer)


def test_scores_the_other_route_as_wrong(tokenizer) -> None:
    """Hand-made outputs: trajectory 0 all right; trajectory 1's reuse turns answer with the other
    route of the record they read (what a reused cache gives), its first turn right."""
    import pandas as pd

    from kvbench.analysis.task_score import score_requests, task_figures

    _, trajectories = generate_trace(TraceSpec(task="role-recall", roles="role-recall", shared_tokens=600,
                                               output_len=3, num_trajectories=2, seed=3), tokenizer)
    rows = []
    for k, trajectory in enumerate(trajectories):
        routes = parse_table(trajectory.shared["q"].text)
        gold = {a.turn_id: a.answer for a in trajectory.task.answers}
        previous = re.search(r"Start from (.+)\.$", trajectory.shared["q"].text).group(1)
        for turn in trajectory.turns:
            reading = reading_of(trajectory.agents[turn.agent].system)
            other = routes[previous][1 - reading]
            answer = other if k == 1 and turn.turn_id != "A0.r0" else gold[turn.turn_id]
            rows.append({"trajectory_id": trajectory.trajectory_id, "turn_id": turn.turn_id, "success": True,
                         "output_token_ids": tokenizer.encode(answer + "\n")})
            previous = gold[turn.turn_id]  # reference-anchored: the next turn reads the gold note
    scores = score_requests(pd.DataFrame(rows), trajectories, tokenizer.decode)
    figures = task_figures(scores)
    assert figures["task_accuracy_first"] == 1.0 and figures["task_accuracy_reuse"] == 0.5
    assert figures["task_accuracy"] == 0.5 and scores["reuse_turn"].sum() == 6


def test_a_role_recall_trace_names_a_model_that_reads_roles(tmp_path) -> None:
    """Replay serves the trace's model by default: a role-recall trace names a role family."""
    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.tracegen.trace_files import read_trace

    out = tmp_path / "t.jsonl"
    made = CliRunner().invoke(main, ["gen-trace", "-o", str(out), "--task", "role-recall", "--shared-tokens", "300",
                                     "--num-trajectories", "1"])
    assert made.exit_code == 0, made.output
    trace = read_trace(out)
    assert trace.header.tokenizer == "kvbench:roles-transferable"
    assert trace.header.generator["roles"] == "role-recall" and trace.trajectories[0].turns[0].max_tokens == 3
