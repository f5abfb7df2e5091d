"""Malformed traces: each gives a clear error naming line and field, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import os
import re
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


HEADER_V2 = {**HEADER, "version": 2, "adapters": {"critic": "/adapters/critic"}}
WITH_ADAPTER = _trajectory(agents={"A0": {"role": "R0", "system": "s0", "system_tokens": 2, "adapter": "critic"},
                                   "A1": {"role": "R1", "system": "s1", "system_tokens": 2}})

CASES = {
    "valid": ([HEADER, _trajectory()], None),
    "valid v2 with an adapter": ([HEADER_V2, WITH_ADAPTER], None),
    "unknown adapter": ([{**HEADER_V2, "adapters": {"other": "/a"}}, WITH_ADAPTER],
                        "line 2: agents.A0.adapter: unknown adapter 'critic' (the header lists other)"),
    "adapter without adapters": ([{**HEADER, "version": 2}, WITH_ADAPTER],
                                 "line 2: agents.A0.adapter: unknown adapter 'critic' (the header lists none)"),
    "adapters in a v1 trace": ([{**HEADER_V2, "version": 1}, _trajectory()],
                               "line 1: adapters: a version 1 trace has no adapters"),
    "not json": ([HEADER, "{not json"], "line 2: not JSON"),
    "empty file": ([], "line 1: the file is empty"),
    "bad version": ([{**HEADER, "version": 3}], "line 1: version: unsupported version 3"),
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
    # JSON's true and "4" are not integers (pydantic's lax mode read them as 1 and 4)
    "bool max_tokens": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[0].update(max_tokens=True)))],
                        "line 2: turns[0].max_tokens: Input should be a valid integer"),
    "string max_tokens": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[0].update(max_tokens="4")))],
                          "line 2: turns[0].max_tokens: Input should be a valid integer"),
    "string arrival": ([HEADER, _trajectory(arrival_s="1.5")], "line 2: arrival_s: Input should be a valid number"),
    "duplicate key": ([HEADER, json.dumps(_trajectory())[:-1] + ', "arrival_s": 5}'],
                      "line 2: duplicate key 'arrival_s' in one object"),
    "duplicate after": ([HEADER, _trajectory(turns=_turns_with(lambda t: t[1].update(after=["A0.r0", "A0.r0"])))],
                        "line 2: turns[1].after[1]: 'A0.r0' is listed twice"),
}


@pytest.fixture(autouse=True)
def _real_tokenizer(tiny_tokenizer_dir: Path) -> None:
    """The traces name a tokenizer that loads (validation re-counts every text with it)."""
    HEADER["tokenizer"] = str(tiny_tokenizer_dir)


def _counted(obj: object) -> object:
    """A trajectory with the token counts its texts really have (as gen-trace writes them); counts
    that are not non-negative ints stay, for the cases about them."""
    if not isinstance(obj, dict) or "turns" not in obj:
        return obj
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(HEADER["tokenizer"])
    obj = json.loads(json.dumps(obj))

    def count(holder: dict, text_key: str, count_key: str) -> None:
        if isinstance(holder.get(count_key), int) and holder[count_key] >= 0 and isinstance(holder.get(text_key), str):
            holder[count_key] = len(tokenizer.encode(holder[text_key]))

    for agent in obj.get("agents", {}).values():
        count(agent, "system", "system_tokens")
    for shared in obj.get("shared", {}).values():
        count(shared, "text", "num_tokens")
    for turn in obj["turns"]:
        for segment in turn.get("segments", []):
            if segment.get("pf") == "text":
                count(segment, "text", "num_tokens")
    return obj


def _write(path: Path, lines: list, counted: bool = True) -> None:
    # headers copied from HEADER before the fixture set its tokenizer get it too
    lines = [{**line, "tokenizer": HEADER["tokenizer"]} if isinstance(line, dict) and line.get("tokenizer") == "x"
             else line for line in lines]
    path.write_text("".join((line if isinstance(line, str) else json.dumps(_counted(line) if counted else line))
                            + "\n" for line in lines))


@pytest.mark.parametrize("case", CASES)
def test_validate_reports_line_and_field(tmp_path: Path, case: str) -> None:
    lines, message = CASES[case]
    path = tmp_path / "trace.jsonl"
    _write(path, lines)
    result = CliRunner().invoke(main, ["trace", "validate", str(path)], prog_name="kvbench")
    if message is None:
        assert result.exit_code == 0 and "1 trajectories, 2 turns" in result.output
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


def _validate(path: Path, *args: str):
    return CliRunner().invoke(main, ["trace", "validate", str(path), *args], prog_name="kvbench")


def _fails_cleanly(result, *messages: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    for message in messages:
        assert message in result.output, result.output


# What replay relies on beyond structure: each of these validated before and crashed replay.
TOKEN_CASES = {
    "count off by 7": (lambda t: t["shared"]["q"].update(num_tokens=t["shared"]["q"]["num_tokens"] + 7),
                       "line 2: shared.q.num_tokens: declares"),
    "count 10^12": (lambda t: t["shared"]["q"].update(num_tokens=10**12),
                    "line 2: shared.q.num_tokens: Input should be less than or equal to"),
    "system count": (lambda t: t["agents"]["A1"].update(system_tokens=t["agents"]["A1"]["system_tokens"] + 1),
                     "line 2: agents.A1.system_tokens: declares"),
    "glue count": (lambda t: t["turns"][1]["segments"][2].update(num_tokens=99),
                   "line 2: turns[1].segments[2].num_tokens: declares 99 tokens"),
    "lone surrogate": (lambda t: t["shared"]["q"].update(text="caf\ud800e"),
                       "line 2: shared.q.text: text cannot be encoded as UTF-8 (character 3"),
}


@pytest.mark.parametrize("case", TOKEN_CASES)
def test_validate_recounts_tokens_with_the_traces_tokenizer(tmp_path: Path, case: str) -> None:
    change, message = TOKEN_CASES[case]
    trajectory = _counted(_trajectory())
    change(trajectory)
    path = tmp_path / "trace.jsonl"
    _write(path, [HEADER, trajectory], counted=False)
    _fails_cleanly(_validate(path), message)


def test_non_finite_arrival_is_refused_and_export_says_so(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    line = json.dumps(_counted(_trajectory())).replace('"arrival_s": 0.0', '"arrival_s": Infinity')
    _write(path, [HEADER, line])
    _fails_cleanly(_validate(path), "line 2: arrival_s: Input should be a finite number")
    export = CliRunner().invoke(main, ["trace", "export", str(path)], prog_name="kvbench")
    _fails_cleanly(export, "line 2: arrival_s")


def test_tokenizer_identity_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write(path, [{**HEADER, "tokenizer_sha256": "0" * 64}, _trajectory()])
    _fails_cleanly(_validate(path), "line 1: tokenizer_sha256: the trace was made with tokenizer",
                   f"{HEADER['tokenizer']!r} has vocabulary sha256")
    _write(path, [{**HEADER, "tokenizer": "/no/such/tokenizer"}, _trajectory()])
    _fails_cleanly(_validate(path), "line 1: tokenizer: cannot load tokenizer '/no/such/tokenizer'")
    # --model names the tokenizer to count with, as replay's --model does
    _write(path, [{**HEADER, "tokenizer": "/no/such/tokenizer"}, _trajectory()])
    assert _validate(path, "--model", HEADER["tokenizer"]).exit_code == 0


def test_a_bad_reference_is_reported_beside_a_bad_field(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write(path, [HEADER, _trajectory(turns=_turns_with(lambda t: t[1].update(max_tokens=0, after=["A9.r0"])))])
    _fails_cleanly(_validate(path), "line 2: turns[1].max_tokens", "line 2: turns[1].after[0]: unknown turn 'A9.r0'")


def test_binary_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" + bytes(range(256)) * 4)
    _fails_cleanly(_validate(path), "line 1: not UTF-8 text")
    path.write_bytes(json.dumps(HEADER).encode() + b"\n\xff\xfe{}\n")
    _fails_cleanly(_validate(path), "line 2: not UTF-8 text")


def test_deeply_nested_json_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write(path, [HEADER, "[" * 100_000 + "]" * 100_000])
    _fails_cleanly(_validate(path), "line 2: not JSON this reader accepts (nested too deeply)")


def test_a_number_of_more_digits_than_python_converts_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write(path, [HEADER, json.dumps(_trajectory()).replace('"arrival_s": 0.0', '"arrival_s": ' + "9" * 5000)])
    _fails_cleanly(_validate(path), "line 2: not JSON this reader accepts (Exceeds the limit")


def _chain(length: int, cycle: bool = False) -> dict:
    """A trajectory of `length` turns, each after the previous and reading its output, listed
    last turn first."""
    turns = [{"turn_id": f"T{i}", "agent": "A0", "after": [f"T{i - 1}"] if i else ([f"T{length - 1}"] if cycle else []),
              "max_tokens": 1, "segments": [{"pf": "system"}, *([{"ph": f"out:T{i - 1}"}] if i else [])]}
             for i in range(length)]
    return _trajectory(turns=turns[::-1])


def test_a_5000_turn_chain_in_reverse_order_validates(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write(path, [HEADER, _chain(5000)])
    result = _validate(path)
    assert result.exit_code == 0, result.output
    assert "1 trajectories, 5000 turns" in result.output
    from kvbench.tracegen.trace_files import read_trace

    (trajectory,) = read_trace(path).trajectories
    assert trajectory.is_ancestor("T0", "T4999") and not trajectory.is_ancestor("T4999", "T0")
    assert trajectory.source_of(trajectory.turn_by_id["T4999"], "out:T4998") == "T4998"
    _write(path, [HEADER, _chain(5000, cycle=True)])
    _fails_cleanly(_validate(path), "line 2: turns.after: dependency cycle T")


def test_validate_checks_turns_against_a_context_length(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write(path, [HEADER, _trajectory()])
    assert _validate(path, "--max-model-len", "4096").exit_code == 0
    # A1.r0 reads A0.r0's 4 output tokens and asks for 4 more: it is the longest turn
    _fails_cleanly(_validate(path, "--max-model-len", "8"), "line 2: turns[1] (A1.r0): needs",
                   "more than max_model_len 8")


def test_a_line_past_the_limit_is_refused_without_reading_it_whole(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trace.jsonl"
    _write(path, [HEADER, _trajectory(shared={"q": {"text": "word " * 5000, "num_tokens": 1}}),
                  _trajectory(trajectory_id="t1", arrival_s="x")], counted=False)
    monkeypatch.setenv("KVBENCH_MAX_TRACE_LINE_BYTES", "4096")
    result = _validate(path)
    # the long line is named with the limit and how to raise it; reading goes on past it
    _fails_cleanly(result, "line 2: longer than 4096 bytes (KVBENCH_MAX_TRACE_LINE_BYTES raises the limit)")
    assert "line 3: arrival_s" in result.output
    monkeypatch.setenv("KVBENCH_MAX_TRACE_LINE_BYTES", "lots")
    _fails_cleanly(_validate(path), "KVBENCH_MAX_TRACE_LINE_BYTES='lots' is not a number of bytes")


def test_a_text_past_the_limit_is_refused_before_tokenizing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trace.jsonl"
    _write(path, [HEADER, _trajectory(shared={"q": {"text": "é" * 600, "num_tokens": 1}})], counted=False)
    monkeypatch.setenv("KVBENCH_MAX_TRACE_TEXT_BYTES", "1000")  # 600 characters, 1,200 bytes
    calls: list[str] = []
    import kvbench.tracegen.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda *a, **k: calls.append("loaded"))
    _fails_cleanly(_validate(path), "shared.q.text: Value error, text larger than 1000 bytes "
                                    "(KVBENCH_MAX_TRACE_TEXT_BYTES raises the limit)")
    assert not calls


@pytest.mark.parametrize("special", ["/dev/zero", "fifo", "directory"])
def test_a_file_that_is_not_regular_is_refused(tmp_path: Path, special: str) -> None:
    from kvbench.tracegen.schema import TraceError
    from kvbench.tracegen.trace_files import read_trace

    path = {"/dev/zero": Path("/dev/zero"), "fifo": tmp_path / "pipe", "directory": tmp_path}[special]
    if special == "fifo":
        os.mkfifo(path)  # no writer: opening it would wait forever
    kind = "a directory" if special == "directory" else "a device, FIFO or socket"
    with pytest.raises(TraceError, match=re.escape(f"not a regular file ({kind})")):
        read_trace(path)
    if special != "directory":  # click refuses a directory itself
        _fails_cleanly(_validate(path), f"not a regular file ({kind})")
