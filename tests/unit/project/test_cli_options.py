"""Options and error paths of the CLI that no other test reached (issue 37 item 9): each bad input
is refused with its own line and the right exit status, and options reach what they configure.
Unit tier: no vLLM engine (servers and sweeps are stood in for where a command would start one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from paths import DATA

from kvbench.cli import main

GOLDEN = DATA / "golden-runs"


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize(("args", "status", "message"), [
    (["replay", "--resume"], 2, "--resume needs the --result-dir of the run to finish"),
    (["replay", "--metadata", "bad", "--base-url", "http://127.0.0.1:1"], 2, "expected KEY=VALUE, got 'bad'"),
    (["replay", "--method-param", "x", "--base-url", "http://127.0.0.1:1"], 2, "expected KEY=VALUE, got 'x'"),
    (["compare", str(GOLDEN), str(GOLDEN), "--pair", "bad"], 2, "'bad': expected BASE=CAND"),
    (["quality", str(GOLDEN / "fullshared"), "--reference", str(GOLDEN / "nonshared"), "--floor",
      str(GOLDEN / "nonshared")], 1, "is not a --drop-shared run: it cannot be PGR's floor"),
    (["quality", str(GOLDEN / "fullshared"), "--reference", str(GOLDEN / "nonshared"), "--naive",
      str(GOLDEN / "fullshared")], 2, "--naive compares PGRs: it needs --floor"),
    (["calibrate", "--method", "fullshared", "--target-rho", "0.5", "--base-url", "http://127.0.0.1:1"], 2,
     "has no reliability gate, reuse budget or layer group to calibrate"),
    (["sweep", "-o", "unused", "--methods", "nonshared", "--shared-tokens", "abc"], 2,
     "expected a comma-separated list of integers, got 'abc'"),
    # nan and inf pass click's bounds; refused before any server starts (issue 38)
    (["replay", "--qps", "nan", "--base-url", "http://127.0.0.1:1"], 2, "'nan' is not a finite number"),
    (["replay", "--qps", "inf", "--base-url", "http://127.0.0.1:1"], 2, "'inf' is not a finite number"),
    (["replay", "--request-timeout", "nan", "--base-url", "http://127.0.0.1:1"], 2, "'nan' is not a finite number"),
    (["replay", "--burstiness", "inf", "--base-url", "http://127.0.0.1:1"], 2, "'inf' is not a finite number"),
    (["replay", "--server-startup-timeout", "inf"], 2, "'inf' is not a finite number"),
    (["gen-trace", "-o", "unused", "--qps", "nan"], 2, "'nan' is not a finite number"),
    (["quickstart", "--qps", "inf"], 2, "'inf' is not a finite number"),
    (["replay", "--method", "kvcmas", "--method-param", "tau=NaN", "--base-url", "http://127.0.0.1:1"], 2,
     "tau: Input should be a finite number (got nan)"),
    (["sweep", "-o", "unused", "--methods", "nonshared", "--qps", "0,nan"], 2,
     "expected a comma-separated list of finite numbers, got '0,nan'"),
])
def test_bad_input_is_one_clear_line(args: list[str], status: int, message: str) -> None:
    result = _invoke(*args)
    assert result.exit_code == status, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_compare_shows_the_metrics_asked_for() -> None:
    result = _invoke("compare", str(GOLDEN), str(GOLDEN), "--metric", "p50_ttft_ms", "--metric", "completed")
    assert result.exit_code == 0
    rows = [line for line in result.output.splitlines() if line.startswith("| ") and "ctx=" in line]
    assert {line.split("|")[3].strip() for line in rows} == {"p50_ttft_ms", "completed"}


def test_a_sweep_directory_holding_another_sweep_is_refused(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Before any server starts: a sweep may only grow by methods."""
    out = tmp_path / "sweep"
    args = ["sweep", "-o", str(out), "--methods", "nonshared", "--shared-tokens", "64", "--qps", "0",
            "--output-len", "4", "--model", str(tiny_tokenizer_dir)]
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"methods": [{"method": "fullshared"}], "shared_tokens": [128]}))
    result = _invoke(*args)
    assert result.exit_code == 1 and "holds a different sweep" in result.output


def test_sweep_method_params_expand_into_configurations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        tiny_tokenizer_dir: Path) -> None:
    from kvbench.experiment import sweep_runner

    seen: dict[str, Any] = {}
    monkeypatch.setattr(sweep_runner, "run_sweep", lambda spec, out, *rest: seen.setdefault("spec", spec))
    result = _invoke("sweep", "-o", str(tmp_path / "s"), "--methods", "nonshared,kvcmas", "--method-param",
                     "kvcmas:V=5,10", "--shared-tokens", "64", "--qps", "0", "--output-len", "4", "--model",
                     str(tiny_tokenizer_dir))
    assert result.exit_code == 0, result.output
    names = [m.name for m in seen["spec"].methods]
    assert names == ["nonshared", "kvcmas-V5", "kvcmas-V10"]
    assert [m.params for m in seen["spec"].methods[1:]] == [{"V": 5}, {"V": 10}]


def test_replay_passes_vllm_args_and_method_params_to_the_server(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """--vllm-arg reaches vLLM's command line and --method-param the connector's config (the server
    is stood in for: it dies at once, and the replay says so)."""
    from kvbench.server import lifecycle as server_module

    configs = []

    class DeadServer:
        def __init__(self, config) -> None:
            configs.append(config)
            self.base_url, self.log_path = "http://127.0.0.1:1", config.log_path
            self.process = SimpleNamespace(returncode=1)

        def __enter__(self):
            from kvbench.server.errors import ServerError

            raise ServerError("stand-in server: not started")

        def __exit__(self, *exc) -> None:
            return None

    monkeypatch.setattr(server_module, "VLLMServer", DeadServer)
    result = _invoke("replay", "--method", "kvcmas", "--method-param", "V=5", "--vllm-arg=--enforce-eager",
                     "--shared-tokens", "64", "--output-len", "4", "--num-trajectories", "1",
                     "--result-dir", str(tmp_path / "run"))
    assert result.exit_code == 1 and "stand-in server" in result.output
    (config,) = configs
    assert "--enforce-eager" in config.extra_args
    assert json.loads(json.dumps(config.kv_transfer_config))["kv_connector_extra_config"]["params"] == {"V": 5}
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


@pytest.mark.parametrize("args, message", [
    # issue 66: a line break in a label reached aiohttp's header check as a traceback
    (["replay", "--label", "fs\nx", "--qps", "0"], "printable characters"),
    (["replay", "--label", "a/b", "--qps", "0"], "printable characters"),
    # sizes past the trace format's own bound, refused before any work (a sweep reached 19 GB)
    (["gen-trace", "--shared-tokens", str((1 << 22) + 1), "-o", "t.jsonl"], "--shared-tokens"),
    (["sweep", "-o", "s", "--shared-tokens", f"64,{(1 << 22) + 1}"], "must be >= 1 and <= 4,194,304"),
    (["sweep", "-o", "s", "--output-len", str((1 << 20) + 1)], "--output-len"),
    # a grid with nothing, or a bad value, in it runs no cell
    (["sweep", "-o", "s", "--qps", ""], "expected at least one"),
    (["sweep", "-o", "s", "--qps", "0,-1"], "-1: each must be >= 0"),
    (["sweep", "-o", "s", "--agents", "1"], "each must be >= 2"),
])
def test_bad_sizes_labels_and_grids_are_refused_up_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         args: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    result = _invoke(*args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing started
