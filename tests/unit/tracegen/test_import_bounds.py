"""`kvbench trace import` is bounded like `trace validate`: hostile and malformed logs and CSVs
are refused quickly, by line and field, in one line each (never a traceback), and nothing is
written unless the whole trace validates."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kvbench.cli import main
from kvbench.tracegen.chat_log import read_chat_log

USER = {"role": "user", "content": "Summarize the incident report for the on-call engineer."}


def _import(tmp_path: Path, log: Path | str, *args: str) -> tuple[Result, Path]:
    out = tmp_path / "out" / "trace.jsonl"
    out.parent.mkdir(exist_ok=True)
    started = time.monotonic()
    result = CliRunner().invoke(main, ["trace", "import", str(log), "-o", str(out), *args])
    assert time.monotonic() - started < 30, "an import must be refused or done quickly"
    return result, out


def _refused(result: Result, out: Path, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # a clear error, not a traceback
    for needle in needles:
        assert needle in result.output, result.output
    assert not any(out.parent.iterdir()), "nothing may be written, not even a temporary file"


def _log(tmp_path: Path, *records: dict | str) -> Path:
    path = tmp_path / "log.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _request(**fields: object) -> dict:
    return {"messages": [USER], "response": "The database credentials rotated at 08:45.", **fields}


@pytest.mark.parametrize("fmt", ["openai-chat", "precache-csv"])
def test_special_files_are_refused_before_reading(tmp_path: Path, fmt: str) -> None:
    result, out = _import(tmp_path, "/dev/zero", "--format", fmt)
    _refused(result, out, "not a regular file")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result, out = _import(tmp_path, fifo, "--format", fmt)  # opening it would wait for a writer forever
    _refused(result, out, "not a regular file")


def test_a_line_over_the_limit_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    huge = _log(tmp_path, _request(), {"messages": [{"role": "user", "content": "x" * (20 << 20)}], "response": "y"})
    result, out = _import(tmp_path, huge)
    _refused(result, out, "line 2: longer than the trace line limit")


def test_a_text_over_the_limit_is_named_by_line_and_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBENCH_MAX_TRACE_TEXT_BYTES", "1000")
    log = _log(tmp_path, _request(), _request(response="z" * 2000))
    result, out = _import(tmp_path, log)
    _refused(result, out, "line 2: response: text of 2000 bytes, over the trace limit of 1000")


@pytest.mark.parametrize("line, message", [
    ("[" * 100_000 + "]" * 100_000, "line 1: not JSON this reader accepts (nested too deeply)"),
    (json.dumps(_request()).replace("Summarize", "\\ud800Summarize"), "line 1: messages[0]: content: text cannot be encoded"),
    (json.dumps(_request(timestamp=1)).replace('"timestamp": 1', '"timestamp": ' + "9" * 3600),
     "line 1: timestamp: must be a number of seconds"),
    (json.dumps(_request(timestamp=1)).replace('"timestamp": 1', '"timestamp": ' + "9" * 5000),
     "line 1: not JSON this reader accepts"),
    (json.dumps(_request(timestamp=float("nan"))), "line 1: timestamp: must be a number of seconds"),
    (json.dumps(_request(id="a\ud800")), "line 1: id: must be non-empty printable text"),
])
def test_hostile_values_are_one_line_errors(tmp_path: Path, line: str, message: str) -> None:
    result, out = _import(tmp_path, _log(tmp_path, line))
    _refused(result, out, message)


def test_a_parent_logged_earlier_with_a_later_timestamp_is_refused(tmp_path: Path) -> None:
    log = _log(tmp_path, _request(id="a", timestamp=5.0), _request(id="b", timestamp=1.0, parent_ids=["a"]))
    result, out = _import(tmp_path, log)
    _refused(result, out, "line 2: parent_ids: 'a' (line 1) has a later timestamp than this request")


def test_a_raw_line_separator_is_text_and_errors_keep_their_line(tmp_path: Path) -> None:
    first = json.dumps(_request(id="a"), ensure_ascii=False).replace("on-call", "on-call\u2028engineer")
    assert "\u2028" in first
    log = _log(tmp_path, first, '{"response": 3}')
    result, out = _import(tmp_path, log)
    _refused(result, out, "line 2: messages: a non-empty list")  # line 2, not 3
    assert "line 1" not in result.output
    records = read_chat_log(_log(tmp_path, first))
    assert "\u2028" in records[0].messages[0][1]


def test_assistant_tool_calls_read_as_openai_defines_them(tmp_path: Path) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "search_logs", "arguments": "{\"q\": \"502\"}"}}
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "08:49:58Z pricing-svc: auth failed"}]
    log = _log(tmp_path, {"messages": messages, "response": "The pricing service cannot authenticate."})
    [record] = read_chat_log(log)
    assert record.messages[1] == ("assistant", "") and json.loads(record.tool_calls[1] or "") == [call]
    result, out = _import(tmp_path, log)
    assert result.exit_code == 0, result.output
    assert "search_logs" in out.read_text()  # the call is part of the prompt, as the server saw it


def _csv(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("agent,prefill_len,decode_len\n" + "".join(r + "\n" for r in rows))
    return path


@pytest.mark.parametrize("row, message", [
    ("planner,100000000000,8", "line 2: prefill_len: must be a whole number of tokens from 1 to 4194304"),
    ("planner,64," + "9" * 5000, "line 2: decode_len: must be a whole number of tokens"),
    ("planner,-3,8", "line 2: prefill_len"),
    ('"' + "x" * 300_000, "line 2:"),
])
def test_csv_counts_are_capped_before_anything_is_expanded(tmp_path: Path, row: str, message: str) -> None:
    result, out = _import(tmp_path, _csv(tmp_path, [row]), "--format", "precache-csv")
    _refused(result, out, message)


def test_a_small_csv_whose_trajectory_cannot_be_one_line_is_refused_before_writing(tmp_path: Path) -> None:
    rows = [f"agent{k % 4},100000,8" for k in range(1000)]  # 20 KB that would expand to 300 MB
    result, out = _import(tmp_path, _csv(tmp_path, rows), "--format", "precache-csv")
    _refused(result, out, "over the trace line limit")


def test_a_trace_that_fails_to_validate_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.tracegen import validate
    from kvbench.tracegen.schema import TraceError

    def refuse(trace: object, tokenizer: object, path: str) -> None:
        raise TraceError(path, ["line 2: shared.s1.num_tokens: declares 3 tokens, the text has 4"])

    monkeypatch.setattr(validate, "check_trace", refuse)
    result, out = _import(tmp_path, _log(tmp_path, _request()))
    _refused(result, out, "declares 3 tokens")


def test_the_text_limit_counts_bytes_not_characters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """600 three-byte characters are 1,800 bytes: over a 1,000-byte limit although under it in
    characters; 300 of them (900 bytes) are under it. Counted in characters, the first would pass."""
    monkeypatch.setenv("KVBENCH_MAX_TRACE_TEXT_BYTES", "1000")
    over = _log(tmp_path, _request(response="\u20ac" * 600))
    result, out = _import(tmp_path, over)
    _refused(result, out, "line 1: response: text of 1800 bytes, over the trace limit of 1000")
    under = tmp_path / "under"
    under.mkdir()
    result, out = _import(under, _log(under, _request(response="\u20ac" * 300)))
    assert result.exit_code == 0, result.output
