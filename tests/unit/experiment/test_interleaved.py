"""Interleaved comparisons (kvbench.experiment.interleaved) on stand-in servers: arms take turns a
trajectory at a time, each run is recorded and summarized as its own, and a drift of the whole
machine halfway through, which a comparison run one method after another reads as a difference
between identical methods, falls on both arms alike."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from kvbench import run_files
from kvbench.experiment.interleaved import Arm, replay_interleaved
from kvbench.experiment.replay import load_trace, replay_config
from kvbench.experiment.run import replay_and_summarize
from kvbench.methods.registry import resolve_method
from kvbench.replay.run_config import ReplayConfig
from kvbench.replay.stub import StubServer

FAST_S, SLOW_S = 0.004, 0.04  # a stand-in prefill before and after the machine slows down
TRAJECTORIES = 8


class Machine:
    """What every stand-in server on one machine shares: after `slow_after` requests in all,
    every prefill takes ten times as long (a neighbour's job started)."""

    def __init__(self, slow_after: int) -> None:
        self.slow_after = slow_after
        self.servers: list[StubServer] = []

    def prefill_s(self) -> float:
        return FAST_S if sum(len(s.bodies) for s in self.servers) <= self.slow_after else SLOW_S


@dataclass
class MachineStub(StubServer):
    machine: Machine | None = None

    @property  # type: ignore[override]
    def prefill_s(self) -> float:
        return self.machine.prefill_s() if self.machine is not None else 0.0

    @prefill_s.setter
    def prefill_s(self, value: float) -> None:  # the machine decides, not the dataclass default
        pass


def _configs(tokenizer_dir: Path, root: Path, urls: dict[str, str]) -> list[ReplayConfig]:
    trace, tokenizer, model = load_trace(None, str(tokenizer_dir), TRAJECTORIES, 0, shared_tokens=64, output_len=3,
                                         seed=5)
    settings: dict[str, Any] = dict(reference_dir=None, trace_path=None, max_load_tokens_per_step=None, qps=0.0,
                                    num_warmups=0, use_trace_timestamps=False, drop_shared=False, logprobs=None,
                                    show_progress=False)
    return [replay_config(trace, tokenizer, model, resolve_method("nonshared"), base_urls=[url], result_dir=root / name,
                          label=name, **settings) for name, url in urls.items()]


def _paired_ratios(root: Path, numerator: str, denominator: str) -> pd.Series:
    """Each trajectory's mean TTFT under one arm over the other's."""
    def per_trajectory(name: str) -> pd.Series:
        return pd.read_parquet(root / name / run_files.REQUESTS).groupby("trajectory_id")["ttft_ms"].mean()
    return per_trajectory(numerator) / per_trajectory(denominator)


@pytest.fixture
def machine() -> Any:
    machine = Machine(slow_after=TRAJECTORIES * 4)  # four agents a trajectory: once one arm's worth has run
    with MachineStub(machine=machine) as a, MachineStub(machine=machine) as b:
        machine.servers = [a, b]
        yield machine


def test_a_drift_between_blocks_reads_as_a_difference_when_run_one_after_another(
        tiny_tokenizer_dir: Path, tmp_path: Path, machine: Machine) -> None:
    a, b = machine.servers
    for config in _configs(tiny_tokenizer_dir, tmp_path, {"first": a.base_url, "second": b.base_url}):
        replay_and_summarize(config)
    assert _paired_ratios(tmp_path, "second", "first").median() > 4  # identical methods, "4x" apart


def test_interleaved_arms_take_turns_and_the_drift_falls_on_both(tiny_tokenizer_dir: Path, tmp_path: Path,
                                                                   machine: Machine) -> None:
    a, b = machine.servers
    configs = _configs(tiny_tokenizer_dir, tmp_path, {"first": a.base_url, "second": b.base_url})
    summaries = replay_interleaved([Arm(config) for config in configs])
    ratios = _paired_ratios(tmp_path, "second", "first")
    assert len(ratios) == TRAJECTORIES and 0.5 < ratios.median() < 2
    assert ratios.max() < 4  # every trajectory's two runs saw the same machine, but the one it slowed during
    # one trajectory at a time: each server saw its turns of a trajectory back to back
    for name, stub in (("first", a), ("second", b)):
        assert summaries[name]["completed"] == TRAJECTORIES * 4 and summaries[name]["failed"] == 0
        config = json.loads((tmp_path / name / run_files.CONFIG).read_text())
        assert config["interleaved"]["arms"] == ["first", "second"]
        assert sorted(config["interleaved"]["measured_places"]) == [0] * 4 + [1] * 4  # first and second alike
        assert stub.max_in_flight == 1
    received = sorted((ns, name) for name, stub in (("first", a), ("second", b)) for ns, _ in stub.timings.values())
    switches = sum(1 for (_, x), (_, y) in zip(received, received[1:]) if x != y)
    # whole trajectories, in an order that rotates: a b | b a | a b ... (a fixed order, a b | a b, switches 15 times)
    assert switches == TRAJECTORIES
    # its duration is its own turns' time, not the other arm's
    duration = sum(s["duration_s"] for s in json.loads((tmp_path / "first" / run_files.CONFIG).read_text())["segments"])
    wall = (max(ns for ns, _ in received) - min(ns for ns, _ in received)) / 1e9
    assert 0 < duration < 0.75 * wall


def test_an_arm_whose_server_is_down_fails_alone_and_the_others_finish(tiny_tokenizer_dir: Path,
                                                                         tmp_path: Path) -> None:
    from kvbench.replay.run_config import ReplayError
    from kvbench.server.errors import ServerError

    with StubServer() as up:
        configs = _configs(tiny_tokenizer_dir, tmp_path, {"up": up.base_url, "down": "http://127.0.0.1:9"})
        with pytest.raises((ServerError, ReplayError)):
            replay_interleaved([Arm(config) for config in configs])
    assert len(pd.read_parquet(tmp_path / "up" / run_files.REQUESTS)) == TRAJECTORIES * 4


def test_arms_need_distinct_labels(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    configs = _configs(tiny_tokenizer_dir, tmp_path, {"same": "http://127.0.0.1:9"})
    with pytest.raises(ValueError, match="distinct labels"):
        replay_interleaved([Arm(configs[0]), Arm(configs[0])])


class StandInServer:
    """VLLMServer's interface over a stand-in server (replay/stub.py) running the config's method."""

    started: list[StandInServer] = []

    def __init__(self, config: Any) -> None:
        extra = (config.kv_transfer_config or {}).get("kv_connector_extra_config", {})
        method = extra.get("method")
        self.config = config
        self.stub = StubServer(connector=method is not None, connector_method=method or "fullshared")
        StandInServer.started.append(self)

    def __enter__(self) -> StandInServer:
        self.stub.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stub.stop()

    base_urls = property(lambda self: [self.stub.base_url])
    pids = property(lambda self: {})
    tier_url = None

    def failure(self) -> None:
        return None

    def command(self) -> list[str]:
        return ["vllm", "stand-in"]

    def describe(self) -> dict[str, object]:
        return {}


def test_replay_compares_several_methods_interleaved_with_the_noise_floor(
        tiny_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvbench replay --method nonshared,fullshared`: a server each and one for the A/A arm, all up
    together, each run in its own folder, turns taken in a rotating order, nothing left running."""
    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.experiment import interleaved
    from kvbench.server import lifecycle

    StandInServer.started = []
    monkeypatch.setattr(lifecycle, "VLLMServer", StandInServer)
    monkeypatch.setattr(interleaved, "side_by_side_shortfall", lambda *args: None)  # whatever this machine has free
    root = tmp_path / "cmp"
    result = CliRunner().invoke(main, ["replay", "--model", str(tiny_tokenizer_dir), "--method", "nonshared,fullshared",
                                       "--qps", "0", "--num-trajectories", "3", "--shared-tokens", "64",
                                       "--output-len", "3", "--result-dir", str(root)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in root.iterdir()) == ["fullshared", "nonshared", "nonshared-aa"]
    methods = [(s.config.kv_transfer_config or {}).get("kv_connector_extra_config", {}).get("method")
               for s in StandInServer.started]
    assert methods == [None, "fullshared", None]  # NonShared, FullShared, the A/A arm's NonShared
    for name in ("nonshared", "fullshared", "nonshared-aa"):
        summary = json.loads((root / name / run_files.SUMMARY).read_text())
        assert summary["completed"] == 12 and summary["label"] == name
        assert summary["machine_load_samples"] >= 1 and 0 <= summary["others_cpu_share"] <= 1  # load recorded
        assert summary["duration_basis"] == "active: its own turns of an interleaved comparison"
        assert json.loads((root / name / run_files.CONFIG).read_text())["interleaved"]["arms"] == [
            "nonshared", "fullshared", "nonshared-aa"]
    assert "nonshared-aa" in result.output and f"kvbench report {root}" in result.output
    # single stream only, and with each method's defaults
    for extra in (["--qps", "1"], ["--method-param", "tau=0.2"], ["--label", "x"]):
        refused = CliRunner().invoke(main, ["replay", "--model", str(tiny_tokenizer_dir), "--method", "nonshared,kvcmas",
                                            "--qps", "0", *extra, "--result-dir", str(tmp_path / "no")])
        assert refused.exit_code == 2 and "compares several methods: it takes no" in refused.output
    assert not (tmp_path / "no").exists()


def test_the_quickstart_compares_its_methods_interleaved_and_reports_them_with_the_noise_floor(
        tiny_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its five steps on stand-in servers: one comparison folder holding NonShared, FullShared, KVCMAS,
    the A/A arm and the no-context floor; the report pairs them and prints the noise floor."""
    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.experiment import interleaved
    from kvbench.server import lifecycle

    StandInServer.started = []
    monkeypatch.setattr(lifecycle, "VLLMServer", StandInServer)
    monkeypatch.setattr(interleaved, "side_by_side_shortfall", lambda *args: None)
    out = tmp_path / "qs"
    result = CliRunner().invoke(main, ["quickstart", "--out", str(out), "--model", str(tiny_tokenizer_dir), "--task",
                                       "none", "--shared-tokens", "64", "--num-trajectories", "3", "--num-warmups", "1"])
    assert result.exit_code == 0, result.output
    (root,) = [p for p in out.iterdir() if p.is_dir() and p.name.startswith("compare-")]
    assert sorted(p.name for p in root.iterdir()) == ["fullshared", "kvcmas", "no-context", "nonshared",
                                                      "nonshared-aa", "report"]
    ids = {json.loads((root / n / run_files.CONFIG).read_text())["comparison"]["id"]
           for n in ("nonshared", "fullshared", "kvcmas", "nonshared-aa")}
    assert len(ids) == 1
    savings = pd.read_csv(root / "report" / "reuse_turn_savings.csv")
    assert set(savings["run"].str.split().str[0]) == {"fullshared", "kvcmas", "nonshared-aa"}
    aa = savings[savings["run"].str.startswith("nonshared-aa")].iloc[0]
    assert aa["reuse_finding"] == "noise floor"
    assert (savings.loc[~savings["run"].str.startswith("nonshared-aa"), "reuse_noise_floor"] == aa["reuse_vs_nonshared"]).all()


def test_servers_that_do_not_fit_side_by_side_run_one_after_another_and_say_what_is_lost(
        tiny_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from kvbench.cli import main
    from kvbench.experiment import interleaved
    from kvbench.server import lifecycle

    StandInServer.started = []
    monkeypatch.setattr(lifecycle, "VLLMServer", StandInServer)
    memory = type("Memory", (), {"available": 4 * 2**30, "total": 8 * 2**30})()
    monkeypatch.setattr(interleaved.psutil, "virtual_memory", lambda: memory)
    root = tmp_path / "cmp"
    result = CliRunner().invoke(main, ["replay", "--model", str(tiny_tokenizer_dir), "--method", "nonshared,fullshared",
                                       "--qps", "0", "--num-trajectories", "2", "--shared-tokens", "64",
                                       "--output-len", "3", "--result-dir", str(root)])
    assert result.exit_code == 0, result.output
    assert "3 servers side by side need about" in result.output and "4.0 GiB are available" in result.output
    assert "a drift on the machine between them reads as a difference between methods" in result.output
    for name in ("nonshared", "fullshared", "nonshared-aa"):
        config = json.loads((root / name / run_files.CONFIG).read_text())
        assert "interleaved" not in config and config["comparison"]["interleaved"] is False
    assert len({json.loads((root / n / run_files.CONFIG).read_text())["comparison"]["id"]
                for n in ("nonshared", "fullshared")}) == 1


def test_a_replay_says_how_many_trajectories_its_warm_ups_leave_and_warns_when_too_few() -> None:
    from kvbench.cli.run_notes import measured_note

    assert measured_note(10, 0) is None
    assert measured_note(10, 3) == "note: the first 3 of the trace's 10 trajectories warm up; 7 are measured"
    few = measured_note(6, 3)
    assert few is not None and "3 are measured" in few and "too few for a useful interval" in few
