"""Malformed traces: each gives a clear error naming line and field, a non-zero exit, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main

HEADER = {"format": "kvbench-trace", "version": 1, "generator": {}, "tokenizer": "x"}


def _trajectory(**overrides) -> dict:
    base = {
        "trajectory_id": "t0", "arrival_s": 0.0,
        "agents": {"A0": {"role": "R0", "system": "s0", "system_tokens": 2},
                   "A1": {"role": "R1", "system": "s1", "system_tokens": 2}},
        "shared": {"q": {"text": "hello", "num_tokens": 1}},
        "turns": [
            {"turn_id": "A0.r0", "agent": "A0", "after": [], "max_tokens": 4,
             "segments": [{"pf": "system"}, {"ph": "q"}]},
            {"turn_id": "A1.r0", "agent": "A1", "after": ["A0.r0"], "max_tokens": 4,
             "segments": [{"pf": "system"}, {"ph": "q"}, {"pf": "text", "text": "said:", "num_tokens": 2},
                          {"ph": "out:A0.r0"}]},
        ],
    }
    base.update(overrides)
    return base


def _turns_with(change) -> list:
    turns = _trajectory()["turns"]
    change(turns)
    return turns


CASES = {
    "valid": ([HEADER, _trajectory()], None),
    "not json": ([HEADER, "{not json"], "line 2: not JSON"),
    "empty file": ([], "line 1: the file is empty"),
    "bad version": ([{**HEADER, "version": 2}], "line 1: version: unsupported version 2"),
    "not a kvbench trace": ([{"timestamp": 1}], "line 1: format"),
    "no trajectories": ([HEADER], "no trajectories"),
    "unknown ph": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[1]["segments"].append({"ph": "doc"})))],
                   "line 2: turns[1].segments[4].ph: unknown shared segment 'doc'"),
    "unknown out": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[1]["segments"].append({"ph": "out:A9.r0"})))],
                    "unknown turn 'A9.r0'"),
    "out not upstream": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[1].update(after=[])))],
                         "turns[1].segments[3].ph: turn 'A0.r0' is not among this turn's predecessors"),
    "cycle": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[0].update(after=["A1.r0"])))],
              "line 2: turns.after: dependency cycle"),
    "missing agent": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[1].update(agent="A7")))],
                      "turns[1].agent: unknown agent 'A7'"),
    "unknown after": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[1].update(after=["A5.r0"])))],
                      "turns[1].after[0]: unknown turn 'A5.r0'"),
    "negative max_tokens": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[0].update(max_tokens=-3)))],
                            "line 2: turns[0].max_tokens"),
    "negative num_tokens": ([HEADER, _trajectory(shared={"q": {"text": "x", "num_tokens": -1}})],
                            "line 2: shared.q.num_tokens"),
    "negative arrival": ([HEADER, _trajectory(arrival_s=-1)], "line 2: arrival_s"),
    "missing field": ([HEADER, {k: v for k, v in _trajectory().items() if k != "turns"}], "line 2: turns: Field required"),
    "both pf and ph": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[0]["segments"].append({"pf": "system", "ph": "q"})))],
                       "exactly one of 'pf' or 'ph'"),
    "duplicate turn": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[1].update(turn_id="A0.r0", after=[])))],
                       "duplicate turn id 'A0.r0'"),
    "duplicate trajectory": ([HEADER, _trajectory(), _trajectory()], "line 3: trajectory_id: duplicate 't0'"),
    "unknown field": ([HEADER, _trajectory(colour="red")], "line 2: colour: Extra inputs are not permitted"),
}


def _write(path: Path, lines: list) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


@pytest.mark.parametrize("case", CASES)
def test_validate_reports_line_and_field(tmp_path: Path, case: str) -> None:
    lines, message = CASES[case]
    path = tmp_path / "trace.jsonl"
    _write(path, lines)
    result = CliRunner().invoke(main, ["trace", "validate", str(path)], prog_name="kvbench")
    if message is None:
        assert result.exit_code == 0 and "valid kvbench-trace v1, 1 trajectories, 2 turns" in result.output
        return
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_all_problems_are_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write(path, [HEADER, "{broken", _trajectory(arrival_s=-2), _trajectory(trajectory_id="t1")])
    result = CliRunner().invoke(main, ["trace", "stats", str(path)], prog_name="kvbench")
    assert result.exit_code == 1
    assert "line 2: not JSON" in result.output and "line 3: arrival_s" in result.output


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["trace", "validate", str(tmp_path / "nope.jsonl")], prog_name="kvbench")
    assert result.exit_code == 1 and "cannot read" in result.output
