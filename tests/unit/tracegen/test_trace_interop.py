"""Trace export for other tools and the round trip back: generate -> export -> import keeps the
turns, dependencies, outputs read and shared spans (tracegen/export.py, tracegen/chat_import.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from peft_folders import v_only_peft

from kvbench.cli import main
from kvbench.tracegen.trace_files import read_trace


def _run(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module", params=["sequential", "fan-out", "fan-in"])
def generated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("interop") / "trace.jsonl"
    _run("gen-trace", "-o", str(path), "--shared-tokens", "256", "--num-trajectories", "2", "--qps", "0",
         "--workflow", request.param, "--output-len", "8")
    return path


def test_generate_export_import_keeps_turns_dependencies_outputs_and_shared_spans(generated: Path,
                                                                                   tmp_path: Path) -> None:
    log, back = tmp_path / "log.jsonl", tmp_path / "back.jsonl"
    _run("trace", "export", str(generated), "--format", "openai-chat", "-o", str(log))
    _run("trace", "import", str(log), "-o", str(back))
    original, imported = read_trace(generated), read_trace(back)
    assert [t.trajectory_id for t in imported.trajectories] == [t.trajectory_id for t in original.trajectories]
    for before, after in zip(original.trajectories, imported.trajectories):
        assert [t.turn_id for t in after.turns] == [t.turn_id for t in before.turns]
        assert {t.turn_id: sorted(t.after) for t in after.turns} == {t.turn_id: sorted(t.after) for t in before.turns}
        outputs = {t.turn_id: sorted(s.ph for s in t.segments if s.ph and s.ph.startswith("out:"))
                   for t in before.turns}
        assert {t.turn_id: sorted(s.ph for s in t.segments if s.ph and s.ph.startswith("out:"))
                for t in after.turns} == outputs
        # the shared context is found again, in one shared segment that holds it (with any text
        # every agent puts around it), read by the same turns
        for key, shared in before.shared.items():
            holders = [k for k, s in after.shared.items() if shared.text in s.text]
            assert len(holders) == 1, key
            readers = {t.turn_id for t in before.turns if key in before.shared_keys(t)}
            assert {t.turn_id for t in after.turns if holders[0] in after.shared_keys(t)} == readers
            assert after.shared[holders[0]].num_tokens <= shared.num_tokens + 16


def test_aiperf_export_runs_each_level_after_the_one_before(generated: Path) -> None:
    records = [json.loads(line) for line in _run("trace", "export", str(generated), "--format", "aiperf").splitlines()]
    trace = read_trace(generated)
    orchestrators = [r for r in records if r.get("orchestrator")]
    assert len(orchestrators) == len(trace.trajectories)
    conversations = {r["session_id"]: r for r in records if not r.get("orchestrator")}
    for trajectory, orchestrator in zip(trace.trajectories, orchestrators):
        rounds = [[s.split("/", 1)[1] for s in r["spawns"]] for r in orchestrator["rounds"]]
        level = {turn: i for i, turn_ids in enumerate(rounds) for turn in turn_ids}
        assert sorted(level) == sorted(t.turn_id for t in trajectory.turns)
        for turn in trajectory.turns:
            assert all(level[p] < level[turn.turn_id] for p in turn.after)  # inputs exist before it is sent
            [body] = conversations[f"{trajectory.trajectory_id}/{turn.turn_id}"]["turns"]
            assert body["max_tokens"] == turn.max_tokens and body["extra"] == {"ignore_eos": True}
            assert body["messages"][0] == {"role": "system", "content": trajectory.agents[turn.agent].system}
            assert trajectory.shared["q"].text in body["messages"][1]["content"]


def test_from_run_times_turns_when_the_run_sent_them_and_fills_its_outputs(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    _run("gen-trace", "-o", str(trace), "--shared-tokens", "64", "--num-trajectories", "1", "--qps", "0",
         "--output-len", "4")
    loaded = read_trace(trace)
    turns = [t.turn_id for t in loaded.trajectories[0].turns]
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame({"trajectory_id": ["t000000"] * 4, "turn_id": turns, "success": [True] * 4,
                  "sent_ns": [10**9 * (5 + 2 * i) for i in range(4)],  # 5 s, 7 s, 9 s, 11 s
                  "output_token_ids": [[11, 12, 13, 14]] * 4}).to_parquet(run / "requests.parquet")
    moon = [json.loads(line) for line in _run("trace", "export", str(trace), "--from-run", str(run)).splitlines()]
    assert [r["timestamp"] for r in moon] == [0, 2000, 4000, 6000]
    chat = [json.loads(line) for line in _run("trace", "export", str(trace), "--format", "openai-chat", "--from-run",
                                              str(run)).splitlines()]
    from kvbench.tracegen.tokenizer import load_tokenizer

    output = load_tokenizer(None).decode([11, 12, 13, 14])
    assert chat[0]["response"] == output and output in chat[1]["messages"][1]["content"]
    assert "[the output of" not in chat[1]["messages"][1]["content"]
    refused = CliRunner().invoke(main, ["trace", "export", str(trace), "--from-run", str(tmp_path)])
    assert refused.exit_code != 0 and "requests.parquet" in refused.output


def test_a_precache_csv_becomes_one_growing_stream_per_trajectory(tmp_path: Path) -> None:
    csv_path, out = tmp_path / "react.csv", tmp_path / "trace.jsonl"
    csv_path.write_text("agent,prefill_len,decode_len\nplan,300,40\naction,120,30\nreflect,80,20\n")
    adapter = v_only_peft(tmp_path / "plan-adapter")
    _run("trace", "import", str(csv_path), "--format", "precache-csv", "--repeats", "2", "-o", str(out),
         "--adapter", f"plan={adapter}")
    trace = read_trace(out)
    assert len(trace.trajectories) == 2 and trace.header.adapters == {"plan-adapter": str(adapter.resolve())}
    first, second = trace.trajectories
    assert first.shared["p0"].text != second.shared["p0"].text  # each lap its own filler
    # turn k's prompt: every earlier prompt and output, then its own new tokens
    assert [first.prompt_tokens(t) for t in first.turns] == [300, 300 + 40 + 120, 300 + 40 + 120 + 30 + 80]
    assert [t.max_tokens for t in first.turns] == [40, 30, 20]
    assert [t.after for t in first.turns] == [[], ["plan.r0"], ["action.r1"]]
    assert first.agents["plan"].adapter == "plan-adapter" and first.agents["action"].adapter is None


def test_a_bad_precache_csv_is_refused_by_line_and_column(tmp_path: Path) -> None:
    csv_path = tmp_path / "bad.csv"
    csv_path.write_text("agent,prefill_len,decode_len\nplan,300,40\n,12,x\n")
    result = CliRunner().invoke(main, ["trace", "import", str(csv_path), "--format", "precache-csv", "-o",
                                       str(tmp_path / "t.jsonl")])
    assert result.exit_code != 0
    assert "line 3: agent: must be" in result.output and "line 3: decode_len: must be a whole number" in result.output
    csv_path.write_text("agent,prefill\nplan,3\n")
    result = CliRunner().invoke(main, ["trace", "import", str(csv_path), "--format", "precache-csv", "-o",
                                       str(tmp_path / "t.jsonl")])
    assert result.exit_code != 0 and "no column prefill_len, decode_len" in result.output
