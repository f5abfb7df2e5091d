"""Fuzzing: thousands of mutations of valid traces. Each one is either refused by `kvbench trace
validate` with a clear error (line and field, exit 1) or replays against the stub server; no
mutation gives a traceback. KVBENCH_FUZZ_MUTATIONS sets how many (default 1500, under a minute on
two cores), KVBENCH_FUZZ_SEED the first seed (default 0): a longer run is
`KVBENCH_FUZZ_MUTATIONS=20000 pytest tests/unit/tracegen/test_trace_fuzz.py`. The unit tier runs the first
QUICK_MUTATIONS of them, the slow (engine) tier the rest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.replay.stub import StubServer
from tests.trace_mutations import OVERSIZE_LIMITS, TraceMutator

MUTATIONS = int(os.environ.get("KVBENCH_FUZZ_MUTATIONS", "1500"))
FIRST_SEED = int(os.environ.get("KVBENCH_FUZZ_SEED", "0"))
QUICK_MUTATIONS = min(MUTATIONS, 300)


@pytest.fixture(scope="module")
def base_lines(tiny_tokenizer_dir: Path) -> list[dict]:
    """Small valid trajectories of several workflow shapes, under one header."""
    from kvbench.tracegen.generate import TraceSpec, generate_trace
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    lines: list[dict] = []
    # few turns, so that each of the hundreds of replays is quick
    for index, (workflow, agents, rounds) in enumerate([("fan-in", 3, 1), ("loop", 2, 2), ("fan-out", 2, 1)]):
        spec = TraceSpec(num_agents=agents, rounds=rounds, workflow=workflow, shared_tokens=24, output_len=2,
                         num_trajectories=1, seed=index, qps=4.0)
        header, (trajectory,) = generate_trace(spec, tokenizer)
        trajectory = trajectory.model_copy(update={"trajectory_id": f"t{index}"})
        if not lines:
            lines.append(header.model_dump(mode="json", exclude_none=True))
        lines.append(trajectory.model_dump(mode="json", exclude_none=True))
    return lines


def _no_traceback(result, what: str) -> None:
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        trace = "".join(traceback.format_exception(result.exception))
        pytest.fail(f"{what}: traceback\n{trace}\noutput:\n{result.output[-2000:]}")
    assert "Traceback" not in result.output, f"{what}:\n{result.output[-3000:]}"


@pytest.mark.parametrize("first, count", [
    pytest.param(FIRST_SEED, QUICK_MUTATIONS, id="quick"),
    pytest.param(FIRST_SEED + QUICK_MUTATIONS, MUTATIONS - QUICK_MUTATIONS, id="rest", marks=pytest.mark.engine),
])
def test_every_mutated_trace_is_refused_clearly_or_replays(base_lines: list[dict], tmp_path: Path, first: int,
                                                           count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if count <= 0:
        pytest.skip("KVBENCH_FUZZ_MUTATIONS leaves no mutations for this part")
    for name, value in OVERSIZE_LIMITS.items():
        monkeypatch.setenv(name, value)
    mutator = TraceMutator(base_lines)
    runner = CliRunner()
    refused: dict[str, int] = {}
    replayed: dict[str, int] = {}
    with StubServer(max_model_len=1024) as stub:
        for seed in range(first, first + count):
            name, data = mutator.mutate(seed)
            path = tmp_path / f"m{seed}.jsonl"
            path.write_bytes(data)
            what = f"mutation {seed} ({name}), file {path}"
            validated = runner.invoke(main, ["trace", "validate", str(path)], prog_name="kvbench")
            _no_traceback(validated, what)
            if validated.exit_code != 0:
                assert validated.exit_code == 1, f"{what}:\n{validated.output}"
                assert "invalid trace" in validated.output and "line " in validated.output, f"{what}:\n{validated.output}"
                refused[name] = refused.get(name, 0) + 1
                path.unlink()
                continue
            replay = runner.invoke(main, ["replay", "--trace", str(path), "--base-url", stub.base_url, "--qps", "0",
                                          "--request-timeout", "10", "--result-dir", str(tmp_path / f"run{seed}")],
                                   prog_name="kvbench")
            _no_traceback(replay, what)
            assert replay.exit_code in (0, 1), f"{what}:\n{replay.output[-3000:]}"
            replayed[name] = replayed.get(name, 0) + 1
    print(f"\n{count} mutations: refused by validate {sum(refused.values())} {refused}; "
          f"replayed {sum(replayed.values())} {replayed}")
    assert sum(refused.values()) > count / 4 and sum(replayed.values()) > count / 20  # both paths exercised
