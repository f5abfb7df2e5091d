"""The replayer against a stub server on loopback: scheduling, chaining, failures, resume, errors."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from kvbench import run_files
from kvbench.cli import main
from kvbench.contracts import Plan
from kvbench.replay.stub import StubServer

SMALL = ["--shared-tokens", "64", "--output-len", "4"]


def _replay(*args: str, model: Path | None = None):
    """`kvbench replay`, its in-memory trace and prompts tokenized by `model` (a tokenizer directory)."""
    return CliRunner().invoke(main, ["replay", *(["--model", str(model)] if model else []), *args],
                              prog_name="kvbench")


@pytest.fixture
def stub():
    with StubServer() as server:
        yield server


def test_requests_chain_outputs_into_prompts(tiny_tokenizer_dir: Path, stub: StubServer, tmp_path: Path) -> None:
    result = _replay("--base-url", stub.base_url, "--qps", "0", "--num-trajectories", "2", *SMALL,
                     "--save-prompt-ids", "--result-dir", str(tmp_path / "r"), model=tiny_tokenizer_dir)
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    assert len(requests) == 8 and requests["success"].all()
    for _, turns in requests.groupby("trajectory_id"):
        by_turn = turns.set_index("turn_id")
        a0_output = list(by_turn.loc["A0.r0", "output_token_ids"])
        assert len(a0_output) == 4
        for later in ("A1.r0", "A2.r0", "A3.r0"):
            prompt = list(by_turn.loc[later, "prompt_token_ids"])
            assert _contains(prompt, a0_output)  # A0's real output is inside every later prompt
            assert stub.prompts[by_turn.loc[later, "request_id"]] == prompt  # what the server received
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["completed"] == 8 and summary["failed"] == 0 and summary["completed_trajectories"] == 2
    # the output's text beside its ids, decoded by the run's tokenizer
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    assert [tokenizer.decode(list(ids)) for ids in requests["output_token_ids"]] == requests["generated_text"].tolist()


def _contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def test_plan_spans_match_prompt_tokens(tiny_tokenizer_dir: Path) -> None:
    from kvbench.replay.prompts import PromptBuilder
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    _, (trajectory,) = generate_trace(TraceSpec(shared_tokens=200, output_len=5, num_trajectories=1), tokenizer)
    builder = PromptBuilder(tokenizer, [], run_id="run")
    outputs, prompts = {}, {}
    for k, turn in enumerate(trajectory.turns):
        prompt = builder.build(trajectory, turn, outputs, prompts)
        plan = Plan.from_params(prompt.plan.to_params())  # what the connector reads
        assert plan is not None and plan == prompt.plan
        assert plan.save_as == f"run/{trajectory.trajectory_id}/{turn.turn_id}"
        q = next(s for s in plan.segments if s.id == "q")
        assert prompt.token_ids[q.start:q.start + q.length] == tokenizer.encode(trajectory.shared["q"].text)
        for segment in plan.segments:
            if segment.kind == "ph" and segment.source:
                assert segment.source_turn is not None and segment.source_start is not None
                source = prompts[segment.source_turn]
                source_cache = source.token_ids + outputs[segment.source_turn]
                start, n = segment.source_start, segment.length
                mine = prompt.token_ids[segment.start:segment.start + n]
                assert source_cache[start:start + n] == mine  # the source span holds the same tokens
                assert segment.source_turn in turn.after  # chained along the workflow edge
        outputs[turn.turn_id] = [100 + k] * 5
        prompts[turn.turn_id] = prompt
    assert plan.segments[2].source is not None  # A3 reuses q from A2


def test_a_later_round_names_the_agents_own_earlier_turns_as_prefix_sources(tiny_tokenizer_dir: Path) -> None:
    """An agent's next round may start with its earlier prompt: the plan names its own finished
    turns, whose exact rows the connector may copy."""
    from kvbench.replay.prompts import PromptBuilder
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    _, (trajectory,) = generate_trace(TraceSpec(shared_tokens=100, output_len=3, num_trajectories=1, workflow="loop",
                                                rounds=2), tokenizer)
    builder = PromptBuilder(tokenizer, [], run_id="run")
    outputs: dict = {}
    prompts: dict = {}
    for turn in trajectory.turns:
        prompt = builder.build(trajectory, turn, outputs, prompts)
        expected = [f"run/{trajectory.trajectory_id}/{t}" for t in prompts if trajectory.turn_by_id[t].agent == turn.agent]
        assert list(prompt.plan.prefix_sources) == expected
        assert set(expected) <= prompt.plan.waits_for
        outputs[turn.turn_id], prompts[turn.turn_id] = [7, 8, 9], prompt
    assert Plan.from_params(prompt.plan.to_params()) == prompt.plan and prompt.plan.prefix_sources  # A3.r1 names A3.r0


def test_arrivals_follow_the_schedule(tiny_tokenizer_dir: Path, stub: StubServer, tmp_path: Path) -> None:
    result = _replay("--base-url", stub.base_url, "--qps", "10", "--arrival", "constant", "--num-trajectories", "20",
                     *SMALL, "--result-dir", str(tmp_path / "r"), model=tiny_tokenizer_dir)
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    first = requests[requests["turn_id"] == "A0.r0"].sort_values("scheduled_ns")
    assert list((first["scheduled_ns"] / 1e6).round().astype(int)) == [100 * i for i in range(20)]
    lag_ms = (first["sent_ns"] - first["scheduled_ns"]) / 1e6
    # open loop: each is sent on time, not after the one before it ends. The median, because one
    # stall of a busy machine delays a single send; benchmarks/bench_replay_overhead.py measures the lag
    assert lag_ms.median() < 50
    # ...and the server saw them arrive 100 ms apart (its own clock, not the schedule's record)
    received_ms = np.array([stub.timings[r][0] for r in first["request_id"]]) / 1e6
    assert np.median(np.diff(received_ms)) == pytest.approx(100, abs=20)


def test_fan_out_turns_run_concurrently(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer
    from kvbench.tracegen.trace_files import write_trace

    header, trajectories = generate_trace(TraceSpec(workflow="fan-out", shared_tokens=32, output_len=8,
                                                    num_trajectories=1), load_tokenizer(str(tiny_tokenizer_dir)))
    write_trace(tmp_path / "t.jsonl", header, trajectories)
    with StubServer(token_delay_s=0.02) as slow:
        result = _replay("--trace", str(tmp_path / "t.jsonl"), "--base-url", slow.base_url, "--qps", "0",
                         "--result-dir", str(tmp_path / "r"), model=tiny_tokenizer_dir)
    assert result.exit_code == 0, result.output
    leaves = pd.read_parquet(tmp_path / "r" / "requests.parquet").query("turn_id != 'A0.r0'")
    assert leaves["sent_ns"].max() < leaves["end_ns"].min()  # all three in flight together


@pytest.mark.parametrize("mode,error_type", [("stream_error", "stream_error"), ("http_500", "http_500"),
                                             ("truncate", "truncated_stream"), ("hang", "timeout")])
def test_request_failures_are_recorded(tiny_tokenizer_dir: Path, tmp_path: Path, mode: str, error_type: str) -> None:
    with StubServer(mode=mode) as bad:
        result = _replay("--base-url", bad.base_url, "--qps", "0", "--num-trajectories", "2", *SMALL,
                         "--request-timeout", "1", "--result-dir", str(tmp_path / "r"), model=tiny_tokenizer_dir)
    assert result.exit_code == 1 and "every request failed" in result.output
    assert error_type in result.output
    requests = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    assert len(requests) == 8 and not requests["success"].any()
    assert requests["error_type"].value_counts().to_dict() == {"dependency_failed": 6, error_type: 2}
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["failed"] == 8 and summary["completed"] == 0 and summary["failed_trajectories"] == 2


def test_resume_finishes_an_interrupted_run(tiny_tokenizer_dir: Path, stub: StubServer, tmp_path: Path) -> None:
    out = tmp_path / "r"
    assert _replay("--base-url", stub.base_url, "--qps", "0", "--num-trajectories", "3", *SMALL,
                   "--result-dir", str(out), model=tiny_tokenizer_dir).exit_code == 0
    journal = out / run_files.REQUESTS_JOURNAL
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:6]) + "\n{\"torn")  # killed mid-way through trajectory 2
    refused = _replay("--base-url", stub.base_url, "--qps", "0", "--num-trajectories", "3", *SMALL,
                      "--result-dir", str(out), model=tiny_tokenizer_dir)
    assert refused.exit_code == 1 and "--resume" in refused.output  # never overwrites
    resumed = _replay("--base-url", stub.base_url, "--qps", "0", "--num-trajectories", "3", *SMALL,
                      "--result-dir", str(out), "--resume", model=tiny_tokenizer_dir)
    assert resumed.exit_code == 0, resumed.output
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == 12 and requests["success"].all()
    assert not requests.duplicated(["trajectory_id", "turn_id"]).any()
    config = json.loads((out / "config.json").read_text())
    assert len(config["segments"]) == 2 and config["segments"][1]["trajectories"] == 2


def test_unknown_method_is_a_usage_error(tmp_path: Path) -> None:
    result = _replay("--method", "telepathy", "--result-dir", str(tmp_path / "r"))
    assert result.exit_code == 2 and "unknown method 'telepathy'" in result.output


def test_unreachable_server_is_a_clear_error(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = _replay("--base-url", f"http://127.0.0.1:{port}", *SMALL, "--result-dir", str(tmp_path / "r"),
                     model=tiny_tokenizer_dir)
    assert result.exit_code == 1 and "cannot reach a vLLM server" in result.output
    assert "Traceback" not in result.output


def test_malformed_trace_is_a_clear_error(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"format": "kvbench-trace", "version": 1, "generator": {}, "tokenizer": "x"}\n{oops\n')
    result = _replay("--trace", str(trace), "--result-dir", str(tmp_path / "r"))
    assert result.exit_code == 1 and "line 2: not JSON" in result.output


def test_port_in_use_is_a_clear_error(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _replay("--port", str(port), *SMALL, "--result-dir", str(tmp_path / "r"), model=tiny_tokenizer_dir)
    assert result.exit_code == 1 and f"port {port}" in result.output and "already in use" in result.output


def test_bad_metric_percentiles(tmp_path: Path) -> None:
    result = _replay("--metric-percentiles", "50,abc", "--result-dir", str(tmp_path / "r"))
    assert result.exit_code == 2 and "--metric-percentiles" in result.output


def test_max_concurrency_caps_the_requests_in_flight(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    with StubServer(token_delay_s=0.02) as slow:
        result = _replay("--base-url", slow.base_url, "--qps", "50", "--num-trajectories", "6", "--max-concurrency",
                         "2", *SMALL, "--result-dir", str(tmp_path / "r"), model=tiny_tokenizer_dir)
        assert result.exit_code == 0, result.output
        assert slow.max_in_flight == 2
        requests = pd.read_parquet(tmp_path / "r" / "requests.parquet")
        assert (requests["client_queue_ms"] > 10).any()  # some waited for a slot
    with StubServer(token_delay_s=0.02) as free:
        assert _replay("--base-url", free.base_url, "--qps", "50", "--num-trajectories", "6", *SMALL,
                       "--result-dir", str(tmp_path / "free"), model=tiny_tokenizer_dir).exit_code == 0
        assert free.max_in_flight > 2  # without the cap the same arrivals overlap more


def test_trace_timestamps_replace_the_qps_schedule(tiny_tokenizer_dir: Path, stub: StubServer, tmp_path: Path) -> None:
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer
    from kvbench.tracegen.trace_files import write_trace

    header, trajectories = generate_trace(TraceSpec(shared_tokens=64, output_len=2, num_trajectories=3),
                                          load_tokenizer(str(tiny_tokenizer_dir)))
    trajectories = [t.model_copy(update={"arrival_s": 5.0 + 0.3 * i}) for i, t in enumerate(trajectories)]
    write_trace(tmp_path / "t.jsonl", header, trajectories)
    result = _replay("--trace", str(tmp_path / "t.jsonl"), "--base-url", stub.base_url, "--qps", "1000",
                     "--use-trace-timestamps", "--result-dir", str(tmp_path / "r"), model=tiny_tokenizer_dir)
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    first = requests[requests["turn_id"] == "A0.r0"].sort_values("scheduled_ns")
    # 0.3 s apart from the first arrival, whatever --qps says
    assert list((first["scheduled_ns"] / 1e6).round().astype(int)) == [0, 300, 600]
    received_ms = np.array([stub.timings[r][0] for r in first["request_id"]]) / 1e6
    # sent on that schedule, not --qps's 1 ms apart: a busy machine can only delay a send, never
    # advance it, so each gap is at least the schedule's (less the clock's slack), loosely bounded above
    gaps = np.diff(received_ms)
    assert (gaps > 300 - 40).all() and (gaps < 3000).all(), gaps


def test_approximate_methods_salt_their_reuse_requests_only(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    with StubServer(connector=True, connector_method="fullshared") as stub:
        assert _replay("--method", "fullshared", "--base-url", stub.base_url, "--qps", "0", "--num-trajectories", "1",
                       *SMALL, "--result-dir", str(tmp_path / "fs"), model=tiny_tokenizer_dir).exit_code == 0
        salts = {rid.rsplit("/", 1)[-1]: body.get("cache_salt") for rid, body in stub.bodies.items()}
    assert salts["A0.r0"] is None  # nothing reused: vLLM's prefix cache may serve it and from it
    for turn in ("A1.r0", "A2.r0", "A3.r0"):
        assert salts[turn] is not None and len(salts[turn]) == 32
    assert len(set(salts.values()) - {None}) == 3  # one salt per request
    with StubServer() as plain:
        assert _replay("--base-url", plain.base_url, "--qps", "0", "--num-trajectories", "1", *SMALL,
                       "--result-dir", str(tmp_path / "ns"), model=tiny_tokenizer_dir).exit_code == 0
        assert all("cache_salt" not in body for body in plain.bodies.values())  # NonShared is exact


def test_sampling_parameters_are_sent_and_recorded(tiny_tokenizer_dir: Path, stub: StubServer, tmp_path: Path) -> None:
    """Greedy by default; other parameters go into every request and config.json, and a resumed run
    must use the ones it was started with."""
    out = tmp_path / "r"
    first = _replay("--base-url", stub.base_url, "--qps", "0", "--num-trajectories", "1", *SMALL,
                    "--result-dir", str(out), model=tiny_tokenizer_dir)
    assert first.exit_code == 0 and "Sampling" in first.output and "greedy" in first.output
    assert {(b["temperature"], b["top_p"], b["top_k"]) for b in stub.bodies.values()} == {(0.0, 1.0, -1)}
    assert json.loads((out / "config.json").read_text())["sampling"] == {
        "temperature": 0.0, "top_p": 1.0, "top_k": -1, "greedy": True}
    hot = tmp_path / "hot"
    assert _replay("--base-url", stub.base_url, "--qps", "0", "--num-trajectories", "1", *SMALL, "--temperature",
                   "0.7", "--top-p", "0.9", "--top-k", "40", "--result-dir", str(hot),
                   model=tiny_tokenizer_dir).exit_code == 0
    sent = [b for rid, b in stub.bodies.items() if b["temperature"] == 0.7]
    assert len(sent) == 4 and all((b["top_p"], b["top_k"]) == (0.9, 40) for b in sent)
    assert json.loads((hot / "config.json").read_text())["sampling"]["greedy"] is False
    refused = _replay("--base-url", stub.base_url, "--qps", "0", "--num-trajectories", "1", *SMALL,
                      "--result-dir", str(hot), "--resume", model=tiny_tokenizer_dir)
    assert refused.exit_code == 1 and "was sampled with" in refused.output
    bad = _replay("--base-url", stub.base_url, "--top-k", "0", "--result-dir", str(tmp_path / "bad"),
                  model=tiny_tokenizer_dir)
    assert bad.exit_code == 2 and "--top-k" in bad.output


def test_prefix_cache_reuse_and_computation_are_counted_apart(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """vLLM's `cached_tokens` counts every token a connector claimed; the records and the summary
    also say what its own prefix cache served, what the method reused and what was computed."""
    with StubServer(connector=True, connector_method="fullshared") as stub:
        assert _replay("--method", "fullshared", "--base-url", stub.base_url, "--qps", "0", "--num-trajectories", "1",
                       *SMALL, "--result-dir", str(tmp_path / "fs"), model=tiny_tokenizer_dir).exit_code == 0
    requests = pd.read_parquet(tmp_path / "fs" / "requests.parquet")
    claimed = requests["reusable_tokens"] > 0  # the first agent reuses nothing: vLLM prefills it, unclaimed
    assert claimed.sum() == 3 and (requests.loc[~claimed, "reused_tokens"] == 0).all()
    assert (requests.loc[claimed, "cached_tokens"] == requests.loc[claimed, "prompt_tokens"] - 1).all()  # every claim
    assert (requests.loc[~claimed, "cached_tokens"] == 0).all()
    assert (requests["prefix_cached_tokens"] == 0).all()  # the stub's connector reports its prefix cache empty
    # the unclaimed turn's figures come from the client, its save's from the server: none missing
    assert requests["method_stats"].notna().all()
    assert (requests.loc[~claimed, "recomputed_tokens"] == requests.loc[~claimed, "prompt_tokens"] - 1).all()
    summary = json.loads((tmp_path / "fs" / "summary.json").read_text())
    assert summary["method_stats_missing"] == 0
    assert summary["prefix_cached_tokens"] == 0 and summary["reused_tokens"] == requests["reused_tokens"].sum() > 0
    assert summary["computed_prompt_tokens"] == (requests["prompt_tokens"] - requests["reused_tokens"]).sum()
    with StubServer() as plain:
        assert _replay("--base-url", plain.base_url, "--qps", "0", "--num-trajectories", "1", *SMALL,
                       "--result-dir", str(tmp_path / "ns"), model=tiny_tokenizer_dir).exit_code == 0
    plain_summary = json.loads((tmp_path / "ns" / "summary.json").read_text())
    assert plain_summary["prefix_cached_tokens"] == plain_summary["cached_tokens"] == 0
    assert plain_summary["computed_prompt_tokens"] == plain_summary["total_input_tokens"]


def test_profile_splits_the_turns_that_reuse_from_those_vllm_prefilled(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """`kvbench profile` reads the connector's per-request stats of a run: the first agent reuses
    nothing (vLLM prefilled it: not claimed, only saved), the three later agents were loaded."""
    with StubServer(connector=True, connector_method="fullshared") as stub:
        assert _replay("--method", "fullshared", "--base-url", stub.base_url, "--qps", "0", "--num-trajectories", "2",
                       *SMALL, "--result-dir", str(tmp_path / "fs"), model=tiny_tokenizer_dir).exit_code == 0
    out = tmp_path / "profile.md"
    result = CliRunner().invoke(main, ["profile", str(tmp_path / "fs"), "--out", str(out)], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    steps, outside = out.read_text().split("Work outside the turns")
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in steps.splitlines()
             if line.startswith("| fullshared fs")]
    assert [row[2:5] for row in cells] == [["reuse turns", "6", "6"], ["turns reusing nothing", "2", "0"]]
    assert "`save_ms`" in steps and "`source_wait_ms`" in steps
    # the stand-in's 2 ms of deferred work per loaded turn (3 per measured trajectory), and the
    # round trip of every stats poll
    (row,) = [[c.strip() for c in line.strip("|").split("|")] for line in outside.splitlines()
              if line.startswith("| fullshared fs")]
    assert row[2:5] == ["8", "12.0", "1.5"] and int(row[5]) >= 1 and float(row[6]) > 0, row
    (tmp_path / "empty").mkdir()
    empty = CliRunner().invoke(main, ["profile", str(tmp_path / "empty")], prog_name="kvbench")
    assert empty.exit_code == 1 and "no kvbench run" in empty.output, empty.output


def test_serve_names_its_log_while_it_starts_and_reports_a_dead_server(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvbench serve` says where vLLM's log goes before the (long) start, keeps it where asked,
    and exits 1 naming the log when the server dies (a stand-in server that exits at once)."""
    from types import SimpleNamespace

    from kvbench.server import lifecycle as server_module

    started = {}

    class DeadServer:
        def __init__(self, config) -> None:
            started["config"] = config
            self.base_url, self.log_path = "http://127.0.0.1:1", config.log_path
            self.process = SimpleNamespace(returncode=3)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

        def is_running(self) -> bool:
            return False

    monkeypatch.setattr(server_module, "VLLMServer", DeadServer)
    log = tmp_path / "serve.log"
    result = CliRunner().invoke(main, ["serve", "--method", "fullshared", "--port", "8123", "--log", str(log)])
    assert result.exit_code == 1
    assert f"log: {log}" in result.output and "starting vLLM (fullshared)" in result.output
    assert "exited with code 3" in result.output and started["config"].log_path == log


@pytest.mark.parametrize(("code", "log", "expected"), [
    (-9, "", ["the vLLM server was killed by SIGKILL"]),
    (3, "", ["the vLLM server exited with code 3"]),
    (0, "INFO ok\nWARNING [shutdown] MPClient: engine core exited unexpectedly; starting cleanup\nINFO bye",
     ["the vLLM server exited with code 0 after its engine process died (", "engine core exited unexpectedly"]),
])
def test_a_servers_end_is_described_by_what_ended_it(code: int, log: str, expected: list[str]) -> None:
    from kvbench.server.lifecycle import exit_description

    described = exit_description(code, log)
    assert all(part in described for part in expected), described
    assert ("engine" in described) == bool(log)


@pytest.mark.parametrize("workflow, rounds, unread", [
    ("sequential", 1, {"A3.r0"}),  # the last agent
    ("loop", 2, {"A3.r1"}),  # every first-round turn is a later round's prefix source
    ("fan-in", 1, {"A3.r0"}),  # the aggregator
])
def test_the_server_keeps_only_caches_a_later_turn_reads(tiny_tokenizer_dir: Path, workflow: str, rounds: int,
                                                          unread: set[str]) -> None:
    """Keeping the last agent's cache would only delay the next engine step; KV-error runs
    (--save-prompt-ids) keep them all."""
    from kvbench.replay.prompts import PromptBuilder, read_caches
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    _, (trajectory,) = generate_trace(TraceSpec(shared_tokens=100, output_len=3, num_trajectories=1, workflow=workflow,
                                                rounds=rounds), tokenizer)
    turns = {t.turn_id for t in trajectory.turns}
    assert turns - read_caches(trajectory) == unread
    for keep_all in (False, True):
        builder = PromptBuilder(tokenizer, [], run_id="run", keep_unread_caches=keep_all)
        outputs: dict = {}
        prompts: dict = {}
        kept = set()
        for turn in trajectory.turns:
            prompt = builder.build(trajectory, turn, outputs, prompts)
            outputs[turn.turn_id], prompts[turn.turn_id] = [7, 8, 9], prompt
            if prompt.plan.keep_cache:
                kept.add(turn.turn_id)
            read = {s.source for s in prompt.plan.segments if s.source} | set(prompt.plan.prefix_sources)
            assert {k.rsplit("/", 1)[1] for k in read} <= kept  # whatever a turn reads was kept
        assert kept == (turns if keep_all else turns - unread)


def test_a_managed_server_that_dies_is_named_not_only_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed server refuses connections a moment before its process is gone: the abort reason
    waits for the process, so it says what happened to it; a server nobody manages is unreachable."""
    import asyncio

    from kvbench.replay import servers

    answers = iter([None, None, None, "the vLLM server was killed by SIGKILL (log: server.log)"])
    reason = asyncio.run(servers.unreachable_reason(lambda: next(answers), "http://h:1", "connection refused"))
    assert reason == "the vLLM server was killed by SIGKILL (log: server.log)"

    monkeypatch.setattr(servers, "UNREACHABLE_GRACE_S", 0.2)
    reason = asyncio.run(servers.unreachable_reason(lambda: None, "http://h:1", "connection refused"))
    assert reason == "server http://h:1 is unreachable (connection refused)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tgkill aims a signal at one thread (Linux)")
def test_the_stub_stops_on_a_sigterm_its_server_thread_receives() -> None:
    """The kernel may hand a process-directed signal (a killed kvbench's parent-death SIGTERM) to any
    thread; Python runs its handler on the main thread only, so the stub must not wait untimed."""
    import ctypes
    import signal
    import subprocess

    from kvbench.server.lifecycle import free_port

    sys_tgkill = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)
    if sys_tgkill is None:
        pytest.skip(f"no tgkill number known for {os.uname().machine}")
    stub = subprocess.Popen([sys.executable, "-m", "kvbench.replay.stub", "--port", str(free_port())],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert stub.stdout is not None and "stub serving" in stub.stdout.readline()
        (server_thread,) = [int(t) for t in os.listdir(f"/proc/{stub.pid}/task") if int(t) != stub.pid]
        assert ctypes.CDLL(None, use_errno=True).syscall(sys_tgkill, stub.pid, server_thread, int(signal.SIGTERM)) == 0
        assert stub.wait(timeout=10) == 0
    finally:
        stub.kill()
        stub.wait()
