"""`kvbench trace import --format openai-chat`: a real agent log as a trace (tracegen/chat_log.py,
tracegen/chat_import.py), on a hand-written three-agent incident-response session."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from paths import DATA

from kvbench.cli import main
from kvbench.replay.import_check import prompt_mismatches
from kvbench.tracegen.chat_import import chat_log_trace
from kvbench.tracegen.chat_log import read_chat_log
from kvbench.tracegen.schema import TraceError
from kvbench.tracegen.tokenizer import load_tokenizer
from kvbench.tracegen.trace_files import read_trace

SESSION = DATA / "chat-session.jsonl"


def _import(records=None):
    records = records if records is not None else read_chat_log(SESSION)
    tokenizer = load_tokenizer(None)
    header, [trajectory] = chat_log_trace(records, tokenizer, min_span_tokens=32)
    return records, tokenizer, header, trajectory


def test_the_session_imports_with_its_agents_dependencies_and_outputs() -> None:
    records, _, header, trajectory = _import()
    assert header.generator["format"] == "openai-chat"
    assert sorted(trajectory.agents) == ["investigator", "planner", "writer"]
    assert [t.turn_id for t in trajectory.turns] == ["planner.r0", "investigator.r0", "writer.r0", "planner.r1"]
    after = {t.turn_id: t.after for t in trajectory.turns}
    assert after == {"planner.r0": [], "investigator.r0": ["planner.r0"], "writer.r0": ["investigator.r0"],
                     "planner.r1": ["writer.r0"]}  # the parent ids as logged
    outputs = {t.turn_id: [s.ph for s in t.segments if s.ph and s.ph.startswith("out:")] for t in trajectory.turns}
    assert outputs["investigator.r0"] == ["out:planner.r0"] and outputs["writer.r0"] == ["out:investigator.r0"]
    assert outputs["planner.r1"] == ["out:planner.r0", "out:writer.r0"]
    assert trajectory.turns[1].max_tokens == len(load_tokenizer(None).encode(records[1].response))


def test_shared_spans_are_found_anywhere_with_the_right_source() -> None:
    records, _, _, trajectory = _import()
    assert len(trajectory.shared) == 2
    incident = next(k for k, s in trajectory.shared.items() if "Incident INC-4471" in s.text)
    logs = next(k for k, s in trajectory.shared.items() if s.text.strip().startswith("2026-11-30T08:49:58Z"))
    assert records[0].messages[1][1].count(trajectory.shared[incident].text) == 1  # cut at token boundaries
    assert len(trajectory.shared[incident].text) > 0.95 * len(records[0].messages[1][1])  # nearly the whole report
    keys = {t.turn_id: [s.ph for s in t.segments if s.ph and not s.ph.startswith("out:")] for t in trajectory.turns}
    assert keys["planner.r0"] == [incident] and keys["investigator.r0"] == [incident, logs]
    assert keys["writer.r0"] == [logs, incident]  # the report after the logs: in the middle of the prompt
    writer = trajectory.turn_by_id["writer.r0"]
    assert trajectory.source_of(writer, incident) == "investigator.r0"  # the latest ancestor holding it
    assert trajectory.source_of(writer, logs) == "investigator.r0"
    assert trajectory.source_of(trajectory.turn_by_id["investigator.r0"], logs) is None  # first seen there


def test_prompts_built_from_the_trace_are_the_logs_token_for_token() -> None:
    records, tokenizer, _, trajectory = _import()
    assert prompt_mismatches(records, [trajectory], tokenizer) == []


def test_without_parent_ids_dependencies_come_from_quoted_outputs(tmp_path: Path) -> None:
    lines = [json.loads(line) for line in SESSION.read_text().splitlines()]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "parent_ids"}) + "\n" for r in lines))
    _, _, _, trajectory = _import(read_chat_log(log))
    assert {t.turn_id: t.after for t in trajectory.turns} == {  # each quoted output: the plan too
        "planner.r0": [], "investigator.r0": ["planner.r0"], "writer.r0": ["investigator.r0"],
        "planner.r1": ["planner.r0", "writer.r0"]}


def test_the_cli_writes_a_valid_trace_and_stats_show_the_edges(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    result = CliRunner().invoke(main, ["trace", "import", str(SESSION), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 shared segments" in result.output and "differ" not in result.output
    assert len(read_trace(out).trajectories) == 1
    stats = CliRunner().invoke(main, ["trace", "stats", str(out), "--json"])
    edges = json.loads(stats.output)["shared_tokens_per_edge"]
    assert edges["investigator->writer"] > 500  # the logs, the incident report and the findings


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1: not JSON"),
    ('{"response": "x"}', "line 1: messages: a non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}], "response": "x"}', "messages[0]: an object with a role"),
    ('{"messages": [{"role": "user", "content": 3}], "response": "x"}', "messages[0]: content must be text"),
    ('{"messages": [{"role": "user", "content": "x"}], "response": " "}', "response: empty"),
    ('{"messages": [{"role": "user", "content": "x"}], "response": "x", "agnet": "a"}', "agnet: unknown field"),
    ('{"messages": [{"role": "user", "content": "x"}], "response": "x", "response": "y"}',
     "line 1: duplicate key 'response' in one object"),
    ('{"messages": [{"role": "user", "content": "x"}], "response": "x", "timestamp": -1}', "timestamp: must be"),
    ('{"messages": [{"role": "user", "content": "x"}], "response": "x", "parent_ids": ["r9"]}',
     "parent_ids: 'r9' is no earlier request's id"),
])
def test_malformed_logs_are_refused_by_line_and_field(line: str, message: str, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text(line + "\n")
    with pytest.raises(TraceError, match=re.escape(message)):
        read_chat_log(log)
    result = CliRunner().invoke(main, ["trace", "import", str(log), "-o", str(tmp_path / "t.jsonl")])
    assert result.exit_code != 0 and message.split(":")[0] in result.output
    assert not (tmp_path / "t.jsonl").exists()


def test_duplicate_ids_are_refused(tmp_path: Path) -> None:
    record = '{"id": "a", "messages": [{"role": "user", "content": "x"}], "response": "y"}'
    log = tmp_path / "log.jsonl"
    log.write_text(record + "\n" + record + "\n")
    with pytest.raises(TraceError, match="invalid openai-chat log .*\n  line 2: id: 'a' is also the id of line 1"):
        read_chat_log(log)


def test_a_short_response_found_elsewhere_is_no_dependency(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    rows = [{"id": "a", "agent": "x", "messages": [{"role": "user", "content": "Is the build green?"}], "response": "Yes"},
            {"id": "b", "agent": "y", "messages": [{"role": "user", "content": "Yes or no: is the deploy done?"}],
             "response": "No, it is still running."}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, _, _, trajectory = _import(read_chat_log(log))
    assert [t.after for t in trajectory.turns] == [[], []]
