"""`gen-trace --task recall` and `kvbench score`: gold answers that follow from the shared
context, and a scorer checked on hand-made outputs (unit tier: the tiny test tokenizer)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from paths import DATA

from kvbench import run_files
from kvbench.analysis.task_score import score_requests, task_figures
from kvbench.cli import main
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.schema import Trace
from kvbench.tracegen.tasks.recall import ARROW, answer_of, recall_output_len
from kvbench.tracegen.tokenizer import load_tokenizer
from kvbench.tracegen.trace_files import read_trace

GOLDEN = DATA / "golden-runs"


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path):
    return load_tokenizer(str(tiny_tokenizer_dir))


def _follow(text: str, start: str, hops: int) -> list[str]:
    """The chain read off the segment's text, as an agent must: line by line."""
    table = dict(line.split(ARROW) for line in text.splitlines() if ARROW in line)
    chain = [start]
    while len(chain) <= hops and chain[-1] in table:  # the chain's last name may have no line
        chain.append(table[chain[-1]])
    return chain


@pytest.mark.parametrize(("workflow", "agents", "rounds"), [("sequential", 4, 1), ("loop", 3, 2),
                                                             ("fan-out", 4, 1), ("fan-in", 4, 1)])
def test_gold_answers_follow_from_the_shared_table(tokenizer, workflow: str, agents: int, rounds: int) -> None:
    spec = TraceSpec(task="recall", roles="recall", workflow=workflow, num_agents=agents, rounds=rounds,
                     shared_tokens=700, output_len=8, num_trajectories=4, seed=3)
    _, trajectories = generate_trace(spec, tokenizer)
    for trajectory in trajectories:
        text = trajectory.shared["q"].text
        assert len(tokenizer.encode(text)) == 700
        start = re.search(r"Start from (.+)\.$", text).group(1)
        task = trajectory.task
        assert task is not None and [a.turn_id for a in task.answers] == [t.turn_id for t in trajectory.turns]
        chain = _follow(text, start, len(trajectory.turns))
        by_turn = {a.turn_id: a for a in task.answers}
        for turn in trajectory.turns:
            seen = [s.ph.removeprefix("out:") for s in turn.segments if s.ph and s.ph.startswith("out:")]
            expected_hop = chain.index(by_turn[seen[-1]].answer) + 1 if seen else 1
            assert by_turn[turn.turn_id].answer == chain[expected_hop], (turn.turn_id, chain)
            # the position is where that hop's line starts in the segment
            line = f"\n{chain[expected_hop - 1]}{ARROW}{chain[expected_hop]}"
            tokens_before = len(tokenizer.encode(text[: text.index(line)]))
            assert abs(by_turn[turn.turn_id].position - tokens_before / 700) < 0.02
        if workflow == "fan-out":  # every follower sees only A0: they all answer hop 2
            assert {by_turn[t.turn_id].answer for t in trajectory.turns[1:]} == {chain[2]}
        # the final turn: farthest along the chain, the latest of those (fan-out: the last follower)
        assert task.final_turn == max(reversed(list(by_turn)), key=lambda t: chain.index(by_turn[t].answer))
    positions = [a.position for t in trajectories for a in t.task.answers]
    assert min(positions) < 0.3 and max(positions) > 0.7  # facts all over the context


def test_recall_traces_validate_and_round_trip(tokenizer, tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "recall.jsonl"
    made = CliRunner().invoke(main, ["gen-trace", "-o", str(out), "--task", "recall", "--shared-tokens", "600",
                                     "--num-trajectories", "3", "--model", str(tiny_tokenizer_dir)])
    assert made.exit_code == 0, made.output
    trace = read_trace(out)
    assert trace.header.generator["task"] == "recall" and trace.header.generator["roles"] == "recall"
    # the task's default output length: the longest name (two words) and a newline, in this tokenizer
    expected = recall_output_len(load_tokenizer(str(tiny_tokenizer_dir)).encode)
    assert expected >= 3 and all(t.max_tokens == expected for t in trace.trajectories[0].turns)
    checked = CliRunner().invoke(main, ["trace", "validate", str(out)])
    assert checked.exit_code == 0, checked.output
    # a task naming a turn the trajectory lacks is reported with its field
    line = json.loads(out.read_text().splitlines()[1])
    line["task"]["answers"][0]["turn_id"] = "A9.r0"
    line["task"]["final_turn"] = "A7.r0"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(out.read_text().splitlines()[0] + "\n" + json.dumps(line) + "\n")
    refused = CliRunner().invoke(main, ["trace", "validate", str(bad)])
    assert refused.exit_code != 0
    assert "task.answers[0].turn_id: unknown turn 'A9.r0'" in refused.output
    assert "task.final_turn: 'A7.r0' has no answer" in refused.output


def test_answer_is_the_first_non_empty_line() -> None:
    assert answer_of(" amber river\nStart from x") == "amber river"
    assert answer_of("\n\n  cedar stone  \n") == "cedar stone"
    assert answer_of("") == "" and answer_of("\n \n") == ""


def test_scores_on_hand_made_outputs(tokenizer) -> None:
    _, trajectories = generate_trace(TraceSpec(task="recall", roles="recall", shared_tokens=500, output_len=8,
                                               num_trajectories=3, seed=5), tokenizer)
    rows = []
    for k, trajectory in enumerate(trajectories[:2]):  # the third was never replayed: not scored
        for gold in trajectory.task.answers:
            agent = gold.turn_id.split(".")[0]
            # trajectory 0: all right (one with trailing text); trajectory 1: A1 wrong, A2 failed
            text = {"A1": "maple maple\n"} if k == 1 else {"A3": gold.answer + "\nStart from"}
            output = text.get(agent, " " + gold.answer + "\n")
            rows.append({"trajectory_id": trajectory.trajectory_id, "turn_id": gold.turn_id,
                         "success": not (k == 1 and agent == "A2"), "output_token_ids": tokenizer.encode(output)})
    scores = score_requests(pd.DataFrame(rows), trajectories, tokenizer.decode)
    assert len(scores) == 8 and scores["trajectory_id"].nunique() == 2
    figures = task_figures(scores)
    assert figures["task_accuracy"] == 1.0  # both final answers (A3) right
    assert figures["task_accuracy_turns"] == 6 / 8
    assert figures["task_accuracy_A1"] == 0.5 and figures["task_accuracy_A2"] == 0.5
    assert figures["task_accuracy_A0"] == 1.0 and figures["task_scored_trajectories"] == 2
    # A0 reads no earlier cache: the first turns (2 of 2 right); A1-A3 reuse (4 of 6 right)
    assert figures["task_accuracy_first"] == 1.0 and figures["task_accuracy_reuse"] == 4 / 6
    failed = scores[(scores["trajectory_id"] == trajectories[1].trajectory_id) & (scores["agent"] == "A2")]
    assert failed["answer"].isna().all() and not failed["correct"].any()


def test_kvbench_score_writes_the_accuracy_into_the_summary(tokenizer, tiny_tokenizer_dir: Path,
                                                            tmp_path: Path) -> None:
    """A run of a task trace recorded elsewhere (here: golden requests given recall outputs)."""
    trace_path = tmp_path / "recall.jsonl"
    assert CliRunner().invoke(main, ["gen-trace", "-o", str(trace_path), "--task", "recall", "--shared-tokens", "500",
                                     "--num-trajectories", "6", "--seed", "2",
                                     "--model", str(tiny_tokenizer_dir)]).exit_code == 0
    trace: Trace = read_trace(trace_path)
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "nonshared", run)
    requests = pd.read_parquet(run / run_files.REQUESTS)
    gold = {(t.trajectory_id, a.turn_id): a.answer for t in trace.trajectories for a in t.task.answers}
    right = requests["trajectory_id"] != requests["trajectory_id"].iloc[0]  # all but one trajectory right
    requests["output_token_ids"] = [tokenizer.encode(gold[(t, u)] + "\n") if ok else tokenizer.encode("x\n")
                                    for t, u, ok in zip(requests["trajectory_id"], requests["turn_id"], right)]
    requests.to_parquet(run / run_files.REQUESTS)
    result = CliRunner().invoke(main, ["score", str(run), "--trace", str(trace_path)])
    assert result.exit_code == 0, result.output
    summary = json.loads((run / run_files.SUMMARY).read_text())
    measured = requests["trajectory_id"].nunique()
    assert summary["task_accuracy"] == pytest.approx((measured - 1) / measured)
    assert summary["task_scored_trajectories"] == measured
    # the summary keeps the score when it is recomputed from the files
    assert CliRunner().invoke(main, ["summarize", str(run)]).exit_code == 0
    assert json.loads((run / run_files.SUMMARY).read_text())["task_accuracy"] == summary["task_accuracy"]
    # a trace without a task cannot be scored, and says so
    plain = tmp_path / "plain.jsonl"
    assert CliRunner().invoke(main, ["gen-trace", "-o", str(plain), "--shared-tokens", "64", "--num-trajectories", "1",
                                     "--model", str(tiny_tokenizer_dir)]).exit_code == 0
    refused = CliRunner().invoke(main, ["score", str(run), "--trace", str(plain)])
    assert refused.exit_code == 1 and "no task to score" in refused.output


def test_a_replay_of_a_task_trace_is_scored_as_it_finishes(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    from kvbench.replay.stub import StubServer

    trace_path = tmp_path / "recall.jsonl"
    assert CliRunner().invoke(main, ["gen-trace", "-o", str(trace_path), "--task", "recall", "--shared-tokens", "300",
                                     "--num-trajectories", "3", "--model", str(tiny_tokenizer_dir)]).exit_code == 0
    with StubServer() as stub:
        result = CliRunner().invoke(main, ["replay", "--trace", str(trace_path), "--base-url", stub.base_url,
                                           "--qps", "0", "--num-warmups", "1", "--result-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / run_files.SUMMARY).read_text())
    scores = pd.read_parquet(tmp_path / "run" / run_files.TASK_SCORES)
    requests = pd.read_parquet(tmp_path / "run" / run_files.REQUESTS)
    assert len(scores) == len(requests) == 2 * 4 and summary["task_scored_trajectories"] == 2
    # the stub answers " t<id>" tokens: never a name from the table
    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    first = requests.iloc[0]
    assert scores.iloc[0]["answer"] == answer_of(tokenizer.decode(list(first["output_token_ids"])))
    assert summary["task_accuracy"] == 0.0 and summary["task_accuracy_A0"] == 0.0


def test_score_finds_the_trace_from_anywhere_or_regenerates_it(tiny_tokenizer_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """config.json records the trace's absolute path (a relative one failed from another folder),
    and when the file is gone `kvbench score` regenerates the trace from its gen-trace settings,
    checked against the trajectories' recorded digests."""
    from kvbench.replay.stub import StubServer

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert CliRunner().invoke(main, ["gen-trace", "-o", "recall.jsonl", "--task", "recall", "--shared-tokens", "300",
                                     "--num-trajectories", "2", "--model", str(tiny_tokenizer_dir)]).exit_code == 0
    with StubServer() as stub:
        replayed = CliRunner().invoke(main, ["replay", "--trace", "recall.jsonl", "--base-url", stub.base_url,
                                             "--qps", "0", "--result-dir", "run"])
    assert replayed.exit_code == 0, replayed.output
    config = json.loads((work / "run" / run_files.CONFIG).read_text())
    assert Path(config["trace_path"]).is_absolute()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert CliRunner().invoke(main, ["score", str(work / "run")]).exit_code == 0
    (work / "recall.jsonl").unlink()
    (work / "run" / run_files.TASK_SCORES).unlink()
    regenerated = CliRunner().invoke(main, ["score", str(work / "run")])
    assert regenerated.exit_code == 0, regenerated.output
    assert (work / "run" / run_files.TASK_SCORES).exists()
