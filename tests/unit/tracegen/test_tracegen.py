"""gen-trace: every workflow shape, exact token counts, determinism, stats and Mooncake export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.tracegen.arrivals import arrival_times
from kvbench.tracegen.export import MOONCAKE_BLOCK_TOKENS, mooncake_records
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.schema import OUT_PREFIX, Trace
from kvbench.tracegen.stats import trace_stats
from kvbench.tracegen.tokenizer import load_tokenizer
from kvbench.tracegen.trace_files import read_trace, write_trace
from kvbench.tracegen.workflows import WORKFLOWS


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path):
    return load_tokenizer(str(tiny_tokenizer_dir))


@pytest.fixture(scope="module")
def embedded_tokenizer():
    """The embedded model's tokenizer: for figures that depend on its vocabulary (it ships with
    the package: no engine and no build, so these tests stay in the unit tier)."""
    return load_tokenizer(None)


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args), prog_name="kvbench")


@pytest.mark.parametrize("workflow", WORKFLOWS)
@pytest.mark.parametrize("agents,rounds", [(2, 1), (4, 1), (4, 3), (8, 2), (3, 8)])
def test_every_workflow_generates_a_valid_trace(tokenizer, tmp_path: Path, workflow: str, agents: int,
                                                rounds: int) -> None:
    spec = TraceSpec(num_agents=agents, rounds=rounds, workflow=workflow, shared_tokens=96, output_len=8,
                     num_trajectories=2, seed=3)
    header, trajectories = generate_trace(spec, tokenizer)
    path = tmp_path / "t.jsonl"
    write_trace(path, header, trajectories)
    trace = read_trace(path)  # full validation, including references and cycles
    assert len(trace.trajectories) == 2
    trajectory = trace.trajectories[0]
    assert set(trajectory.agents) == {f"A{i}" for i in range(agents)}
    assert len({a.system for a in trajectory.agents.values()}) == agents  # distinct role prompts
    by_id = trajectory.turn_by_id
    expected_turns = {"loop": 1 + (agents - 1) * rounds}.get(workflow, agents * rounds)
    assert len(trajectory.turns) == expected_turns
    for turn in trajectory.turns:
        visible = {s.ph[len(OUT_PREFIX):] for s in turn.segments if s.ph and s.ph.startswith(OUT_PREFIX)}
        assert visible == trajectory.ancestors[turn.turn_id]  # each agent sees every upstream output
        assert turn.segments[0].pf == "system" and any(s.ph == "q" for s in turn.segments)
    if workflow == "fan-out":
        assert all(by_id[f"A{a}.r0"].after == ["A0.r0"] for a in range(1, agents))
    if workflow == "fan-in":
        assert by_id[f"A{agents - 1}.r0"].after == [f"A{a}.r0" for a in range(agents - 1)]
    if workflow == "loop":
        assert [t.turn_id for t in trajectory.turns if t.agent == "A0"] == ["A0.r0"]
        if rounds > 1:
            assert by_id["A1.r1"].after == [f"A{agents - 1}.r0"]


def test_shared_context_has_exact_token_count_and_prompts_add_up(tokenizer) -> None:
    for shared_tokens in (1, 17, 2048, 8192):
        _, trajectories = generate_trace(TraceSpec(shared_tokens=shared_tokens, num_trajectories=2, seed=5),
                                         tokenizer)
        for trajectory in trajectories:
            q = trajectory.shared["q"]
            assert q.num_tokens == shared_tokens == len(tokenizer.encode(q.text))
            for turn in trajectory.turns:
                # Segment-by-segment encoding, as the replayer builds prompts.
                total = 0
                for segment in turn.segments:
                    if segment.pf == "system":
                        total += len(tokenizer.encode(trajectory.agents[turn.agent].system))
                    elif segment.pf == "text":
                        assert segment.num_tokens == len(tokenizer.encode(segment.text))
                        total += segment.num_tokens
                    else:
                        total += trajectory.segment_tokens(segment, turn)
                assert total == trajectory.prompt_tokens(turn)


def test_each_trajectory_has_its_own_natural_looking_context(embedded_tokenizer) -> None:
    tokenizer = embedded_tokenizer
    _, trajectories = generate_trace(TraceSpec(shared_tokens=512, num_trajectories=5), tokenizer)
    texts = [t.shared["q"].text for t in trajectories]
    assert len(set(texts)) == 5
    words = texts[0].split()
    assert len(set(words)) > 100  # varied vocabulary, not a repeated filler
    assert sum(w[0].isupper() for w in words) > len(words) / 20  # sentences


def test_same_seed_same_bytes_different_seed_different_content(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    paths = {}
    for name, seed in [("a", 11), ("b", 11), ("c", 12)]:
        paths[name] = tmp_path / f"{name}.jsonl"
        result = _invoke("gen-trace", "--model", str(tiny_tokenizer_dir), "-o", str(paths[name]),
                         "--num-trajectories", "3", "--seed", str(seed), "--shared-tokens", "300")
        assert result.exit_code == 0, result.output
    assert paths["a"].read_bytes() == paths["b"].read_bytes()
    assert paths["a"].read_bytes() != paths["c"].read_bytes()
    qa = json.loads(paths["a"].read_text().splitlines()[1])["shared"]["q"]["text"]
    qc = json.loads(paths["c"].read_text().splitlines()[1])["shared"]["q"]["text"]
    assert qa != qc


def test_header_records_every_parameter(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    result = _invoke("gen-trace", "-o", str(path), "--agents", "3", "--rounds", "2", "--workflow", "loop",
                     "--shared-tokens", "64", "--output-len", "16", "--num-trajectories", "2", "--qps", "4",
                     "--arrival", "gamma", "--burstiness", "0.5", "--roles", "code", "--seed", "9")
    assert result.exit_code == 0, result.output
    header = read_trace(path).header
    assert header.generator.items() >= {"num_agents": 3, "rounds": 2, "workflow": "loop", "shared_tokens": 64,
                                     "output_len": 16, "num_trajectories": 2, "qps": 4.0, "arrival": "gamma",
                                     "burstiness": 0.5, "roles": "code", "seed": 9}.items()
    assert header.tokenizer.startswith("kvbench:") and header.tokenizer_sha256


def test_arrival_processes() -> None:
    times = arrival_times(200, qps=4.0, process="poisson", seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert math.isclose(times[-1], 199 / 4.0, rel_tol=1e-6)  # rescaled to the nominal rate
    assert arrival_times(4, qps=2.0, process="constant") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(3, qps=0) == [0.0, 0.0, 0.0]  # single stream
    bursty = arrival_times(2000, qps=1.0, process="gamma", burstiness=0.25, seed=2)
    smooth = arrival_times(2000, qps=1.0, process="gamma", burstiness=4.0, seed=2)
    cv = lambda t: (lambda g: (sum((x - sum(g) / len(g)) ** 2 for x in g) / len(g)) ** 0.5 / (sum(g) / len(g)))(  # noqa: E731
        [b - a for a, b in zip(t, t[1:])])
    assert cv(bursty) > 1.5 > 0.8 > cv(smooth)  # CV = 1/sqrt(burstiness): 2 and 0.5
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, qps=1, burstiness=0)


def test_stats_shared_tokens_per_edge_and_reuse(embedded_tokenizer) -> None:
    tokenizer = embedded_tokenizer
    header, trajectories = generate_trace(TraceSpec(shared_tokens=1000, output_len=50, num_trajectories=2),
                                          tokenizer)
    stats = trace_stats(Trace(header=header, trajectories=trajectories))
    assert stats["turns"] == 8
    # Sequential, accumulated: edge A(k-1)->Ak carries q plus the k upstream outputs.
    assert stats["shared_tokens_per_edge"] == {"A0->A1": 1050.0, "A1->A2": 1100.0, "A2->A3": 1150.0}
    reuse = stats["max_reuse_fraction_per_agent"]
    assert reuse["A0"] == 0.0 and all(0.8 < reuse[a] < 1.0 for a in ("A1", "A2", "A3"))


def test_mooncake_export_chains_block_hashes(tokenizer) -> None:
    header, trajectories = generate_trace(TraceSpec(num_agents=3, workflow="fan-out", shared_tokens=1500,
                                                    num_trajectories=2, qps=2.0), tokenizer)
    trace = Trace(header=header, trajectories=trajectories)
    records = list(mooncake_records(trace))
    assert len(records) == 6
    for record, (trajectory, turn) in zip(records, [(t, u) for t in trajectories for u in t.turns]):
        assert record["input_length"] == trajectory.prompt_tokens(turn)
        assert record["output_length"] == turn.max_tokens
        assert len(record["hash_ids"]) == math.ceil(record["input_length"] / MOONCAKE_BLOCK_TOKENS)
        assert record["timestamp"] == round(trajectory.arrival_s * 1000)
        assert record["parent"] == turn.after
    # The same agent's first block differs across trajectories (q differs), so ids never collide...
    all_ids = [i for r in records for i in r["hash_ids"]]
    assert len(all_ids) == len(set(all_ids))
    # ...and an identical prompt gets identical ids (content-addressed, prefix-chained).
    again = list(mooncake_records(Trace(header=header, trajectories=[trajectories[0]])))
    assert [r["hash_ids"] for r in again] == [r["hash_ids"] for r in records[:3]]


def test_cli_stats_and_export(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    generated = _invoke("gen-trace", "--model", str(tiny_tokenizer_dir), "-o", str(path), "--num-trajectories", "2",
                        "--shared-tokens", "600")
    assert generated.exit_code == 0, generated.output
    validated = _invoke("trace", "validate", str(path))
    assert validated.exit_code == 0 and "valid kvbench-trace v2, 2 trajectories, 8 turns" in validated.output
    stats = _invoke("trace", "stats", str(path), "--json")
    assert stats.exit_code == 0 and json.loads(stats.output)["turns"] == 8
    assert "A0->A1" in _invoke("trace", "stats", str(path)).output
    out = tmp_path / "mooncake.jsonl"
    exported = _invoke("trace", "export", str(path), "--format", "mooncake", "-o", str(out))
    assert exported.exit_code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and {"timestamp", "input_length", "output_length", "hash_ids", "session_id",
                               "agent_id", "parent"} <= set(rows[0])


@pytest.mark.parametrize("args,message", [
    (["--agents", "9"], "--agents"),
    (["--rounds", "0"], "--rounds"),
    (["--workflow", "ring"], "--workflow"),
    (["--shared-tokens", "0"], "--shared-tokens"),
    (["--qps", "-1"], "--qps"),
    (["--burstiness", "0"], "--burstiness"),
    (["--roles", "poets"], "--roles"),
])
def test_gen_trace_rejects_bad_flags(tmp_path: Path, args: list[str], message: str) -> None:
    result = _invoke("gen-trace", "-o", str(tmp_path / "t.jsonl"), *args)
    assert result.exit_code == 2 and message in result.output


def test_a_fan_in_agent_reads_the_shared_context_through_one_edge(embedded_tokenizer) -> None:
    """Every predecessor of a fan-in agent holds q, but the agent reads it once: from the latest
    predecessor (where a method reuses it), and each other edge carries only that agent's output."""
    spec = TraceSpec(workflow="fan-in", num_agents=6, shared_tokens=400, output_len=16, num_trajectories=1)
    header, trajectories = generate_trace(spec, embedded_tokenizer)
    edges = trace_stats(Trace(header=header, trajectories=trajectories))["shared_tokens_per_edge"]
    assert edges == {"A0->A5": 16.0, "A1->A5": 16.0, "A2->A5": 16.0, "A3->A5": 16.0, "A4->A5": 416.0}
